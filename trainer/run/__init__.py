"""One RL training run, in parts that each read top to bottom: the loop (loop.py), which alone holds the whole
`Run`; one step (step.py) over its batch (step_batch.py); the batches it trains on (producer.py), the models
(policies.py), the checkpointed state (state.py), the measured objective (measurement.py) and the run
directory (directory.py). The names other code uses are here."""

from trainer.run.directory import DirectoryTaken
from trainer.run.errors import EXIT_PREEMPTED, TIMING_KEYS, Preempted, TrainingError
from trainer.run.loop import Run, SigtermFlag, train
from trainer.run_files import COMPLETE

__all__ = ["COMPLETE", "EXIT_PREEMPTED", "TIMING_KEYS", "DirectoryTaken", "Preempted", "Run", "SigtermFlag",
           "TrainingError", "train"]
