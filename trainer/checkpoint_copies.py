"""What a run's checkpoint holds, in copies of its weights: free of torch, so that the study's budget
(sweep.study.budget) prices what the train state saves (trainer.run.state.Checkpoints.state asks
`holds_reference` whether to save the reference)."""

from __future__ import annotations

from typing import Any, Mapping

from trainer.config import RunConfig, from_dict


def holds_reference(config: RunConfig) -> bool:
    """A reference that moves (objective.ref_refresh_every) is part of the run's state, saved whole."""
    return bool(config.objective.ref_refresh_every)


def weight_copies(config: RunConfig | Mapping[str, Any]) -> dict[str, int]:
    """The checkpoint's copies of the weights, by what they are: the policy's weights, AdamW's two moments
    (exp_avg and exp_avg_sq, in the weights' dtype), and the reference where it moves."""
    config = config if isinstance(config, RunConfig) else from_dict(dict(config))
    copies = {"weights": 1, "AdamW's moments": 2}
    if holds_reference(config):
        copies["the reference"] = 1
    return copies
