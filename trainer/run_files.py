"""The files a run directory holds, and their one reader: the trainer writes them, sweep reads them.

The run directory is the source of truth about its run: COMPLETE, written last, says it is finished
(nothing ever opens a finished run again); FAILED says why its last attempt stopped, and where its
log is (`train.log`, the run's own log, every attempt appended); a live lease (trainer.lease) says
a trainer holds it now. Kept free of torch so that the study level can import it cheaply.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
COMPLETE = "COMPLETE"
FAILED = "FAILED"                                 # why the last attempt failed (JSON), until the next one starts
TRAIN_LOG = "train.log"                           # the run's own log, every attempt appended
OBJECTIVE = "objective.jsonl"                     # the regularized objective measured at some steps
OBJECTIVE_REFERENCE = "objective_reference.json"  # the reference's reward histogram per held-out prompt


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl (or objective.jsonl) lines, in order; a torn last line (a run killed mid-write) is dropped."""
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return lines


def count_lines(path: Path) -> int:
    """Whole lines of a jsonl file (the steps a run has logged), without parsing them."""
    try:
        return Path(path).read_bytes().count(b"\n")
    except OSError:
        return 0


def record_failure(run_dir: Path, reason: str, step: int | None) -> None:
    """Write FAILED: the reason, the step reached, where the log is, when and where it failed."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"reason": reason, "step": step, "log": str(run_dir / TRAIN_LOG), "host": socket.gethostname(),
              "slurm_job": os.environ.get("SLURM_JOB_ID"), "failed": time.time()}
    tmp = run_dir / f".{FAILED}.{os.getpid()}"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, run_dir / FAILED)


def read_failure(run_dir: Path) -> dict[str, Any] | None:
    """FAILED's record, or None if the run's last attempt did not fail."""
    try:
        return json.loads((Path(run_dir) / FAILED).read_text())
    except (OSError, ValueError):
        return None


def clear_failure(run_dir: Path) -> None:
    (Path(run_dir) / FAILED).unlink(missing_ok=True)
