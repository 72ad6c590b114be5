"""The run's exit status and errors, apart so that every part of a run can raise them without importing the loop."""

from __future__ import annotations

from trainer.exit_status import EXIT_PREEMPTED  # noqa: F401 (re-exported: the run returns it)

TIMING_KEYS = ("step_time", "gen_time", "train_time", "tokens_per_s")  # the only non-reproducible metrics


class TrainingError(RuntimeError):
    """A run that cannot go on (for example too many non-finite updates in a row)."""


class Preempted(Exception):
    """Raised after the checkpoint that SIGTERM asked for has been written (none before the first step)."""
