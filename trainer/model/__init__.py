"""The model: loading, importing and locating models, their output layer (lean head), dropout off,
and the trainer's log-probs (whole and chunked)."""
