"""What the executor says while sacct fails. submitit reads every job's state with one sacct call; when
that call fails (SLURM's accounting daemon, slurmdbd, or its database down), submitit logs "Bypassing
sacct error" at its own logger and keeps the states it had, so a study waits on its jobs without a word.
SacctWatch listens to that logger and turns a run of failures into one message a minute that names the
cause, and says when sacct answers again."""

from __future__ import annotations

import logging
from typing import Literal

FAILURES_BEFORE_WARNING = 3
SECONDS_BETWEEN_WARNINGS = 60.0


class SacctWatch(logging.Handler):
    """Counts submitit's sacct failures; `after_update` says what to tell the user, if anything."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failures, self.last_error = 0, ""
        self._seen, self.streak, self._said = 0, 0, None

    @classmethod
    def attach(cls) -> "SacctWatch":
        watch = cls()
        logging.getLogger("submitit").addHandler(watch)
        return watch

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "sacct error" in message:
            self.failures += 1
            self.last_error = message

    def after_update(self, now: float, jobs: int) -> tuple[Literal["info", "error"], str] | None:
        """(the executor logger's method, message) after one sacct call for `jobs` followed jobs, or None.
        Snakemake's executor logger has info, error and debug: the failures go out as errors, to be seen."""
        failed = self.failures > self._seen
        self._seen = self.failures
        if not failed:
            recovered = self.streak >= FAILURES_BEFORE_WARNING
            self.streak = 0
            self._said = None
            return ("info", "sacct answers again: the jobs' states are read anew") if recovered else None
        self.streak += 1
        if self.streak < FAILURES_BEFORE_WARNING or (self._said is not None and
                                                      now - self._said < SECONDS_BETWEEN_WARNINGS):
            return None
        self._said = now
        return ("error",
                f"sacct has failed {self.streak} times in a row ({self.last_error}): SLURM's job accounting "
                f"(slurmdbd and its database) does not answer, so the states of the {jobs} jobs followed are "
                "unknown and Snakemake waits for them. Check that `sacct` works on this node; the study goes on "
                "by itself once it does (jobs that finished meanwhile are seen then).")
