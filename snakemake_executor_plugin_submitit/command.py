"""The callable that submitit runs on a node: one Snakemake job's command, requeued on timeout.

SLURM signals a job `signal_delay_s` before its time limit (submitit asks for USR2) and, on
clusters that preempt that way, before preemption. submitit then calls `checkpoint`: the command
gets SIGTERM and a grace period to save its state (the klstudy trainer checkpoints after the
current step and exits), and the same command is requeued. Run again, it resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import submitit

log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """The job's command exited with a non-zero status."""


class JobCommand(submitit.helpers.Checkpointable):
    """Run `command` with bash in its own process group; on checkpoint, stop it gently and requeue."""

    def __init__(self, command: str, grace_s: float) -> None:
        self.command = command
        self.grace_s = grace_s
        self._process: subprocess.Popen | None = None

    def __call__(self) -> int:
        # launch.py started the task with USR2 blocked; submitit's handler is installed now, so a warning
        # that came while it loaded is taken here (checkpoint, requeue) and later ones as they come.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
        # The command ignores USR2: SLURM sends it to every process of the step, and its default
        # action would kill the command before it could save anything. It inherits SIGTERM's default.
        self._process = subprocess.Popen(
            ["/bin/bash", "-c", self.command], start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
        status = self._process.wait()
        if status != 0:
            raise JobFailed(f"the job's command exited with status {status}")
        return status

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """SIGTERM to the command's process group, wait for all of it (at most grace_s), requeue."""
        process = self._process
        if process is not None and process.poll() is None:
            log.warning("timeout or preemption: stopping the job (grace %.0f s), then requeueing", self.grace_s)
            _signal_group(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline and _group_alive(process.pid):
                process.poll()  # reap the leader so that only live members count
                time.sleep(0.2)
            if _group_alive(process.pid):
                _signal_group(process.pid, signal.SIGKILL)
        fresh = JobCommand(self.command, self.grace_s)
        return submitit.helpers.DelayedSubmission(fresh)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def live_stat(stat: Path) -> list[str] | None:
    """The fields of a /proc/PID/stat after the command name (state, parent, group, ...), or None when the
    process has ended or is a zombie."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:  # the process ended while we looked
        return None
    return None if fields[0] in ("Z", "X") else fields


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in the group. Orphans of the command are reaped by
    the node's init, which in a container may never happen: zombies must not count."""
    return any((fields := live_stat(stat)) and int(fields[2]) == pgid for stat in Path("/proc").glob("[0-9]*/stat"))
