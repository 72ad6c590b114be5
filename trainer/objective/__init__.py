"""The objective: the estimators, placements and advantages (registries), the KL and its exact
full-vocabulary form, the loss and its config, the peers' settings and presets."""
