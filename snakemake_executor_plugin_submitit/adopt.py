"""Jobs that an earlier Snakemake run submitted and that SLURM still runs: followed, not submitted again.

The Snakemake process on the login node can die (a dropped SSH session, a reboot, the OOM killer)
while its SLURM jobs go on. Run again, the same command would submit every unfinished job a second
time, and two copies of a training job would write one run directory. Instead, every submission
is recorded in its submitit folder (`klstudy-jobs.jsonl`: the SLURM job id and the job's rule and
wildcards), and a new run reads the records of the folders beside its own. A job it is about to
submit that an earlier run submitted and SLURM still has (the job is in `squeue`) is followed
as if it had submitted it: its state, its log, Ctrl-C's scancel. The new run records it too, so
that a third run finds it again.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

from snakemake_interface_executor_plugins.utils import encode_target_jobs_cli_args

RECORD = "klstudy-jobs.jsonl"
log = logging.getLogger(__name__)


def key(job) -> str:
    """A job's identity across Snakemake runs: its rule and wildcards, as Snakemake names the job to the
    process that runs it (`--target-jobs`). Not its outputs: a job of several grid points covers the
    ones still pending, fewer once some have finished, under the same rule."""
    return json.dumps(sorted(encode_target_jobs_cli_args(job.get_target_spec())))


def record(folder: Path, entries: list[tuple[str, Path, str]]) -> None:
    """Append (SLURM job id, its submitit folder, its key) for jobs this run follows."""
    with (folder / RECORD).open("a") as handle:
        for job_id, job_folder, identity in entries:
            handle.write(json.dumps({"job_id": job_id, "folder": str(job_folder), "job": identity}) + "\n")


def _queued() -> set[str] | None:
    """Ids of this user's jobs that SLURM still has (array tasks one by one), or None if squeue failed."""
    shown = subprocess.run(["squeue", "--me", "-h", "-r", "-o", "%i"], capture_output=True, text=True, timeout=60)
    return set(shown.stdout.split()) if shown.returncode == 0 else None


def still_running(parent: Path) -> dict[str, tuple[Path, str]]:
    """Job key -> (submitit folder, SLURM job id) of recorded jobs under `parent`'s folders that SLURM
    still has."""
    recorded: dict[str, tuple[Path, str]] = {}
    for path in sorted(Path(parent).glob(f"*/{RECORD}"), key=lambda p: p.stat().st_mtime):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
                recorded[entry["job"]] = (Path(entry["folder"]), str(entry["job_id"]))
            except (ValueError, KeyError):
                continue  # a line torn by a hard kill
    if not recorded:
        return {}
    queued = _queued()
    if queued is None:
        log.warning("squeue failed: jobs of earlier runs of this study cannot be found; none is adopted")
        return {}
    return {outputs: found for outputs, found in recorded.items() if found[1] in queued}
