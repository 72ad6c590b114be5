"""Running chosen outputs again from scratch: they are moved aside, never deleted.

`--config rerun=...` names what to run again, comma-separated:
- `failed`: every grid point whose last attempt failed;
- `changed`: every run and evaluation made otherwise than the study says now (sweep.study.changes);
- a run id (the point: its run and its evaluations), or an evaluation's key, as `python -m sweep status`
  and the study's messages print it (`<run id>/<suite>`, `<run id>/step_<N>/<suite>`): that evaluation only.

A run's directory and evaluations move to `<results>/discarded/<time>/runs/<id>` and `.../eval/<id>`, an
evaluation's to `.../eval/<its key>`, so that a mistyped id loses nothing; the MLflow child run of each point
is retired (the next sync deletes it and opens a new one from the run directory, sweep.tracking.run_sync), so that
MLflow shows nothing that was discarded. The study then plans them as new. Nothing moves unless everything
named can be: a name the study does not have is one error with the nearest names, and a point that a
trainer holds now (a live lease) is one error naming the holder.

Stale evaluations (their model is no longer there: sweep.study.changes) move aside the same way, whether or not
anything is named, so that they are redone with their run.

The Snakefile runs `discard` before it plans: one command that reruns exactly those outputs, bundled or
not, locally or through profiles/slurm. In a dry run nothing moves, and the plan counts them as to do.
"""

from __future__ import annotations

import difflib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sweep.study import jobs
from sweep.study.changes import Survey
from sweep.study.checks import StudyError
from sweep.study.grid import Study
from sweep.tracking import sync_records
from trainer.lease import current_holder, describe, seems_alive
from trainer.run_files import COMPLETE, read_failure

log = logging.getLogger(__name__)

DISCARDED = "discarded"
SELECTORS = ("failed", "changed")


@dataclass(frozen=True)
class Discarded:
    """What is (or, in a dry run, would be) moved aside: grid points (run ids, with their evaluations), and
    evaluations of points that stay (keys), chosen or stale."""

    runs: list[str] = field(default_factory=list)
    evaluations: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)

    @property
    def all_evaluations(self) -> set[str]:
        return {*self.evaluations, *self.stale}


def chosen(study: Study, which: Any, survey: Survey | None = None) -> tuple[list[str], list[str]]:
    """(run ids, evaluation keys) that `which` names: selectors and names, a list or one string with commas.
    An evaluation of a chosen run is not listed apart."""
    names = which if isinstance(which, list) else str(which).split(",")
    names = list(dict.fromkeys(str(name).strip() for name in names if str(name).strip()))
    if not names:
        raise StudyError("rerun: name what to rerun (run ids or evaluation keys, comma-separated), `failed` or "
                         "`changed`")
    runs_known = {run.run_id for run in study.runs}
    evals_known = {target.key for target in jobs.evaluations(study)}
    runs, evals = [], []
    for name in names:
        if name == "failed":
            runs += [run.run_id for run in study.runs if _failed(study.results / "runs" / run.run_id)]
        elif name == "changed":
            survey = survey if survey is not None else _survey(study)
            runs += [change.output for change in survey.runs]
            evals += [change.output for change in survey.evaluations]
        elif name in runs_known:
            runs.append(name)
        elif name in evals_known:
            evals.append(name)
        else:
            near = difflib.get_close_matches(name, sorted(runs_known | evals_known), n=3)
            raise StudyError(f"rerun: {name} is neither a grid point nor an evaluation of study {study.name}"
                             + (f" (did you mean {', '.join(near)}?)" if near else "")
                             + f", nor one of {', '.join(SELECTORS)}; nothing was discarded (`python -m sweep status` "
                             "lists the points)")
    runs = list(dict.fromkeys(runs))
    return runs, [key for key in dict.fromkeys(evals) if key.split("/")[0] not in runs]


def _survey(study: Study) -> Survey:
    from sweep.study.changes import survey

    return survey(study)


def _failed(run_dir: Path) -> bool:
    return not (run_dir / COMPLETE).exists() and read_failure(run_dir) is not None


def discard(study: Study, which: Any = None, survey: Survey | None = None, dry_run: bool = False) -> Discarded:
    """Move aside what `which` names (None: nothing) and the survey's stale evaluations (with `dry_run`, only
    say what); what was (or would be) moved."""
    runs, evals = chosen(study, which, survey) if which is not None else ([], [])
    stale = [key for key in (survey.stale if survey is not None else []) if key.split("/")[0] not in runs]
    for run_id in runs:  # an evaluation moves while its run trains: the trainer never opens it
        holder = current_holder(study.results / "runs" / run_id)
        if holder is not None and seems_alive(holder):
            raise StudyError(f"rerun: {run_id} is being trained now, by {describe(holder)}: nothing was discarded "
                             "(let it finish or stop it first)")
    chosen_ones = Discarded(runs, [key for key in evals if key not in stale], stale)
    if dry_run or not (runs or evals or stale):
        return chosen_ones
    bin_ = study.results / DISCARDED / time.strftime("%Y%m%d-%H%M%S")
    for run_id in runs:
        _retire(study, run_id)  # first: an older klstudy's records are in the run directory
        for source, kind in ((study.results / "runs" / run_id, "runs"), (study.results / "eval" / run_id, "eval")):
            _move(source, bin_ / kind / run_id)
        jobs.forget(study, run_id)
        log.info("rerun: %s discarded (its outputs are in %s)", run_id, bin_)
    for key in chosen_ones.all_evaluations:
        _retire(study, key.split("/")[0])
        _move(study.results / "eval" / key, bin_ / "eval" / key)
        jobs.forget_evaluation(study, key)
        log.info("rerun: evaluation %s discarded (it is in %s)", key, bin_)
    return chosen_ones


def _move(source: Path, target: Path) -> None:
    if source.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, target)


def _retire(study: Study, run_id: str) -> None:
    """The point's MLflow child runs, to be deleted by the next sync (which opens a new one)."""
    for key, run_ids in sync_records.claimed_children(study.results, run_id).items():
        sync_records.retire(sync_records.run_records(study.results, run_id, key), run_ids)


def said(study: Study, discarded: Discarded, done: bool, named: bool) -> list[str]:
    """What the study says of what it moved aside (`done`) or would (a dry run); `named`: a rerun was asked."""
    lines = []
    if named:
        what = ", ".join([*discarded.runs, *discarded.evaluations]) or "none"
        said_ = "discarded, to run again from scratch" if done else "would be discarded and run again"
        lines.append(f"klstudy rerun: {len(discarded.runs)} point(s) and {len(discarded.evaluations)} evaluation(s) "
                     f"{said_}: {what}")
    if discarded.stale:
        shown = ", ".join(discarded.stale[:3]) + (f" and {len(discarded.stale) - 3} more" if len(discarded.stale) > 3
                                                   else "")
        moved = f"moved to {study.results / DISCARDED}/" if done else "would be moved aside"
        lines.append(f"klstudy: {len(discarded.stale)} evaluation(s) scored a model that is no longer there (its run "
                     f"is not finished, or was trained again since): {moved} and evaluated again with it: {shown}")
    return lines
