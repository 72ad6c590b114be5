"""Jobs that SLURM requeued after their node failed. sacct reports such a job NODE_FAIL (its last record) while
slurmctld has already queued it again (JobRequeue=1, the default for batch jobs), and submitit's watcher, which
asks sacct, takes it for finished and stops following it: the study would fail a job that SLURM is about to run
again, and never see it end. For a job in one of these states, slurmctld's own state (`scontrol show job`) says
whether it lives on; if so, the watcher follows it again. One scontrol call per such job and status check, only
while sacct says NODE_FAIL: nothing for the others, however large the study."""

from __future__ import annotations

import re
import subprocess

import submitit

AFTER_NODE_FAILURE = {"NODE_FAIL", "BOOT_FAIL"}  # what sacct shows of a job requeued after its node failed
# COMPLETING too: a job whose processes on the dead node cannot report is followed until slurmctld settles it
ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
         "SUSPENDED"}


def controller_state(job_id: str) -> str | None:
    """The job's state as slurmctld holds it now, or None where it no longer knows the job (or cannot say)."""
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\bJobState=(\S+)", shown.stdout)
    return found.group(1) if shown.returncode == 0 and found else None


def requeued(job_id: str) -> str | None:
    """For a job that sacct reports failed with its node: its state now if slurmctld still holds it, requeued or
    settling (submitit's watcher then follows it again), else None."""
    state = controller_state(job_id)
    if state not in ALIVE:
        return None
    # submitit keeps the jobs it took for finished in this set and asks sacct no more about them: the one
    # place this plugin reaches into it (tests/test_cluster_hosts.py's node death fails if it changes)
    submitit.SlurmJob.watcher._finished.discard(job_id)
    return state
