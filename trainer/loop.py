"""The names `trainer.loop` has always offered; the run itself is the package trainer.run."""

from trainer.run import COMPLETE, EXIT_PREEMPTED, TIMING_KEYS, DirectoryTaken, Preempted, Run, TrainingError, train
from trainer.run.metrics import mismatch_sums
from trainer.run.producer import PendingBatch

__all__ = ["COMPLETE", "EXIT_PREEMPTED", "TIMING_KEYS", "DirectoryTaken", "PendingBatch", "Preempted", "Run",
           "TrainingError", "mismatch_sums", "train"]
