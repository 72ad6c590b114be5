"""Rerunning chosen grid points from scratch: their outputs are moved aside, never deleted.

`discard(study, which)` takes "failed" (every point whose last attempt failed) or run ids. Each point's
run directory and evaluations move to `<results>/discarded/<time>/runs/<id>` and `.../eval/<id>`, so
that a mistyped id loses nothing; its MLflow child run is retired (the next sync deletes it and opens a
new one, sweep.run_sync). The study then plans those points as new. Nothing moves unless every point
can be discarded: an id the study does not have is one error with the nearest ids, and a point that a
trainer holds now (a live lease) is one error naming the holder.

Snakemake runs it for `--config rerun=failed` or `--config rerun=ID[,ID...]` (the Snakefile, before it
plans): one command that reruns exactly those points, bundled or not, locally or through profiles/slurm.
"""

from __future__ import annotations

import difflib
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from sweep import jobs, sync_records
from sweep.checks import StudyError
from sweep.grid import Study
from trainer.lease import current_holder, describe, seems_alive
from trainer.run_files import COMPLETE, read_failure

log = logging.getLogger(__name__)

DISCARDED = "discarded"


def chosen(study: Study, which: Any) -> list[str]:
    """The run ids that `which` names: "failed", or ids (a list, or one string with commas)."""
    if which == "failed":
        return [run.run_id for run in study.runs if _failed(study.results / "runs" / run.run_id)]
    ids = which if isinstance(which, list) else str(which).split(",")
    ids = [str(i).strip() for i in ids if str(i).strip()]
    if not ids:
        raise StudyError("rerun: name the points to rerun (run ids, comma-separated) or `failed`")
    known = {run.run_id for run in study.runs}
    unknown = [i for i in ids if i not in known]
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        raise StudyError(f"rerun: {unknown[0]} is not a grid point of study {study.name}"
                         + (f" (did you mean {', '.join(near)}?)" if near else "")
                         + "; nothing was discarded (`python -m sweep status` lists the points)")
    return list(dict.fromkeys(ids))


def _failed(run_dir: Path) -> bool:
    return not (run_dir / COMPLETE).exists() and read_failure(run_dir) is not None


def discard(study: Study, which: Any, dry_run: bool = False) -> list[str]:
    """Move the chosen points' outputs aside (with `dry_run`, only say which); the ids."""
    ids = chosen(study, which)
    for run_id in ids:
        holder = current_holder(study.results / "runs" / run_id)
        if holder is not None and seems_alive(holder):
            raise StudyError(f"rerun: {run_id} is being trained now, by {describe(holder)}: nothing was discarded "
                             "(let it finish or stop it first)")
    if dry_run or not ids:
        return ids
    bin_ = study.results / DISCARDED / time.strftime("%Y%m%d-%H%M%S")
    for run_id in ids:
        run_dir, eval_dir = study.results / "runs" / run_id, study.results / "eval" / run_id
        children = sync_records.claimed_children(run_dir)
        for source, kind in ((run_dir, "runs"), (eval_dir, "eval")):
            if source.exists():
                (bin_ / kind).mkdir(parents=True, exist_ok=True)
                shutil.move(source, bin_ / kind / run_id)
        for key, run_ids in children.items():
            sync_records.retire(sync_records.records_dir(run_dir, key), run_ids)
        jobs.forget(study, run_id)
        log.info("rerun: %s discarded (its outputs are in %s)", run_id, bin_)
    return ids
