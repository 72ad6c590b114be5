"""The run directory as functions of its path: who holds it, which config it is for, what survives a restart,
and how a run ends in it (FAILED, COMPLETE). None of this needs a model, so none of it lives on the run."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path

import yaml

from trainer.config import ConfigError, RunConfig, as_saved, differences, digest
from trainer.distributed import World
from trainer.lease import Lease, slurm_job
from trainer.run.errors import TrainingError
from trainer.run_files import (
    COMPLETE,
    CONFIG,
    METRICS,
    OBJECTIVE,
    TRAIN_LOG,
    clear_failure,
    read_metrics,
    record_failure,
)

log = logging.getLogger(__name__)


class DirectoryTaken(ConfigError):
    """--out holds a run started with another config: the run is someone else's, so nothing is written there."""


def checkpoints_dir(out: Path) -> Path:
    return out / "checkpoints"


def claim(out: Path, config: RunConfig, world: World) -> Lease | None:
    """The main process takes the run directory's lease (trainer.lease), then writes config.yaml, or
    checks that a run already here was started with the same config; every process then raises its
    error, if any (none is left waiting). The main process's lease, else None."""
    problem, lease = None, None
    if world.main:
        try:
            lease = Lease.acquire(out)
            check_or_write_config(out, config)
            clear_failure(out)  # this attempt replaces the last one's record
        except ValueError as error:  # ConfigError, LeaseHeld, DirectoryTaken
            if lease is not None:
                lease.release()
                lease = None
            problem = error
    problems = [p for p in world.gather(problem) if p]  # the errors themselves, pickled
    if problems:
        raise problems[0]
    return lease


def check_or_write_config(out: Path, config: RunConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config_file = out / CONFIG
    wanted = config.to_dict()
    if config_file.exists():
        changed = differences(wanted, as_saved(yaml.safe_load(config_file.read_text())))
        if changed:
            raise DirectoryTaken(f"--out {out}", f"holds a run with a different config ({', '.join(changed)}); "
                                 "use another --out, or the same config to resume it")
    else:
        config_file.write_text(yaml.safe_dump(wanted, sort_keys=False))


def truncate_metrics(out: Path, step: int) -> None:
    """Drop metrics of steps after the checkpoint (and a torn last line): they are run again. A
    metrics line is numbered by the step it trained, an objective line by the updates before it."""
    for name, last in ((METRICS, step - 1), (OBJECTIVE, step)):
        path = out / name
        if path.exists():
            kept = [line for line in read_metrics(path) if line["step"] <= last]
            path.write_text("".join(json.dumps(line) + "\n" for line in kept))


def is_complete(out: Path) -> bool:
    return (out / COMPLETE).exists()


def mark_complete(out: Path, lease: Lease, steps: int, config: RunConfig) -> None:
    """COMPLETE, the run directory's last write (after its log is closed): from now on nothing opens it. It
    names the config its model was trained under (trainer.config.digest), so that an evaluation, which records
    COMPLETE's digest as its model's, names it too."""
    lease.check()
    record = {"steps": steps, "finished": time.time(), "config_sha256": digest(config)}
    (out / COMPLETE).write_text(json.dumps(record) + "\n")


def record_error(out: Path, error: Exception, step: int | None, main: bool) -> None:
    """Log why the run failed and, from the main process, record it in FAILED (trainer.run_files)."""
    where = f"at step {step}" if step is not None else "before its first step"
    if isinstance(error, (ValueError, TrainingError)):
        log.error("the run failed %s: %s", where, error)
        reason = str(error)
    else:  # a bug or a broken machine: the traceback goes into the run's log
        log.exception("the run failed %s", where)
        reason = f"{type(error).__name__}: {error}"
    if main:
        record_failure(out, reason, step)


@contextlib.contextmanager
def run_log(out_dir: Path, main: bool):
    """The run's own log, `<run>/train.log`: what this process logs while it trains the run, appended."""
    if not main:
        yield
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out_dir / TRAIN_LOG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    log.info("attempt started: pid %d on %s%s", os.getpid(), socket.gethostname(),
             f", SLURM job {slurm_job()}" if slurm_job() else "")
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
