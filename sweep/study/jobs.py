"""What a study still has to do, and the jobs that do it: no finished grid point is ever in a job.

The run directories say what is finished: a run with COMPLETE (the trainer writes it last), an
evaluation with its metrics.json (written last, atomically). The Snakefile gives Snakemake rules for
pending work only. Snakemake sees each run and evaluation through a file of its own,
`<results>/.jobs/<rule>/<run or evaluation>.done`: a job writes them when it succeeds, and the main
process keeps them in step with the run directories before it plans (one for every finished run and
evaluation, none for the others). So Snakemake never deletes, touches or marks as incomplete what the
trainer and the evaluation wrote, a finished run or evaluation is a plain input to what follows it,
and no job reopens or rewrites it, whatever was killed and whenever.

Bundles (`bundle.train`, `bundle.evaluate` in the study config) group pending work of one model (and,
for evaluations, one suite) into jobs. A bundle is recorded when it is first planned
(`<results>/.jobs/<rule>/<key>.json`, the key a digest of its members) and keeps its name while it has
pending members, so that
- a job started on a compute node, which reads the Snakefile again, finds the very bundle it was
  submitted for (the main process's record, not a new plan from a later state of the results);
- a SLURM job that outlived the Snakemake that submitted it is recognized by the next one, which
  follows it rather than submitting it again (the executor knows a job by its rule's name).

A bundle's job covers the members still pending when the main process plans; the record says which,
and a job's own process reads them from it. Pending points that no recorded bundle holds (new seeds, a
new beta, a point discarded for a rerun) form new bundles, in grid order. Only the main Snakemake
process records and forgets bundles (never in a dry run) and writes `.done` files itself.

A job's own process must find the very job it was submitted for even when that job's work is already
finished: SLURM requeues a job that is signalled (time limit, preemption) as its run completes, and
the requeued job reads the Snakefile again. So a job's process defines a rule for every run and
evaluation, and each bundle with the members recorded as pending when it was planned; the trainer and
the evaluation leave a finished one as it is, and the job ends as a success.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Hashable

from eval.harness import METRICS_FILE
from sweep.study.grid import Study
from trainer.run_files import COMPLETE

log = logging.getLogger(__name__)

JOBS = ".jobs"


@dataclass(frozen=True)
class EvalTarget:
    """One evaluation a study asks for: a run's final model (step None) or checkpoint, on one suite."""

    run: str
    step: int | None
    suite: str

    @property
    def where(self) -> str:
        """Its directory under results/eval/<run>: <suite>, or step_<N>/<suite>."""
        return self.suite if self.step is None else f"step_{self.step}/{self.suite}"

    @property
    def key(self) -> str:
        """Its directory under results/eval, which names it: <run>/<suite> or <run>/step_<N>/<suite>."""
        return f"{self.run}/{self.where}"


@dataclass(frozen=True)
class Bundle:
    """A job's worth of pending work: `pending` of the recorded `members` (run ids or evaluation keys)."""

    rule: str
    key: str
    members: tuple[str, ...]
    pending: tuple[str, ...]

    @property
    def name(self) -> str:
        """The Snakemake rule that runs it (stable while it has pending members)."""
        return f"{self.rule}_{self.key}"


@dataclass(frozen=True)
class Work:
    """What the study still has to do, and its jobs: for the main process, the pending runs and
    evaluations, in grid order; for a job's own process, every run and evaluation a job may be for."""

    root: Path                   # <results>/.jobs
    runs: list[str]
    evaluations: list[EvalTarget]
    train_bundles: list[Bundle]
    evaluate_bundles: list[Bundle]

    def done(self, rule: str, item: str) -> Path:
        """Snakemake's file for a run (rule train) or an evaluation (evaluate, by its key): present when it
        is finished."""
        return done_file(self.root, rule, item)


def done_file(root: Path, rule: str, item: str) -> Path:
    return root / rule / f"{item}.done"


def run_finished(study: Study, run_id: str) -> bool:
    return (study.results / "runs" / run_id / COMPLETE).is_file()


def evaluation_file(study: Study, target: EvalTarget) -> Path:
    return study.results / "eval" / target.key / METRICS_FILE


def evaluations(study: Study) -> list[EvalTarget]:
    """Every evaluation the study asks for, run by run (so that a bundle waits for few training jobs)."""
    return [EvalTarget(run.run_id, step, suite) for run in study.runs
            for step in [*study.eval_steps(run.run_id), None] for suite in study.evaluate["suites"]]


def plan(study: Study, record: bool, redo_runs: Collection[str] = (), redo_evaluations: Collection[str] = ()) -> Work:
    """The study's pending work and its jobs, for the main Snakemake process. `record`: write new bundles
    and forget those with nothing left to do (not in a dry run); else only recorded bundles are kept and
    new ones are planned without a trace. `redo_runs`, `redo_evaluations`: finished ones a dry run counts as
    to do (a real run has moved them aside: sweep.study.rerun)."""
    runs, evals, train_group, eval_group = _pending(study, set(redo_runs), set(redo_evaluations))
    _mirror(study, set(runs), {target.key for target in evals}, forget_pending=record)
    return Work(study.results / JOBS, runs, evals, _bundles(study, "train", runs, train_group, record),
                _bundles(study, "evaluate", [t.key for t in evals], eval_group, record))


def recorded(study: Study) -> Work:
    """The main process's plan as recorded, for a job's own Snakemake process (on a compute node, perhaps
    requeued after its work finished): every run and evaluation, and every recorded bundle with the
    members pending when it was planned. Nothing new is planned."""
    runs = [run.run_id for run in study.runs]
    return Work(study.results / JOBS, runs, evaluations(study), _recorded(study, "train"),
                _recorded(study, "evaluate"))


def _mirror(study: Study, runs: set[str], evals: set[str], forget_pending: bool) -> None:
    """The `.done` files in step with the run directories: one for each finished run and evaluation (a job
    killed after finishing some of them wrote none; a dry run needs them too), and, with
    `forget_pending` (only where no other Snakemake can run), none for the pending ones (a point
    discarded, or a run directory deleted by hand)."""
    root = study.results / JOBS
    items = [("train", run.run_id, run.run_id in runs) for run in study.runs]
    items += [("evaluate", target.key, target.key in evals) for target in evaluations(study)]
    for rule, item, pending in items:
        path = done_file(root, rule, item)
        if pending:
            if forget_pending:
                path.unlink(missing_ok=True)
        elif not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()


def forget(study: Study, run_id: str) -> None:
    """Remove a run's and its evaluations' `.done` files (the run is to be trained again from scratch)."""
    root = study.results / JOBS
    done_file(root, "train", run_id).unlink(missing_ok=True)
    for target in evaluations(study):
        if target.run == run_id:
            forget_evaluation(study, target.key)


def forget_evaluation(study: Study, key: str) -> None:
    """Remove an evaluation's `.done` file (it is to be evaluated again)."""
    done_file(study.results / JOBS, "evaluate", key).unlink(missing_ok=True)


def _pending(study: Study, redo_runs: set[str], redo_evaluations: set[str]):
    """Pending runs and evaluations, in grid order, and what groups them into jobs (for runs: the model;
    for evaluations: the model and the suite)."""
    runs = [run.run_id for run in study.runs if run.run_id in redo_runs or not run_finished(study, run.run_id)]
    evals = [target for target in evaluations(study) if target.run in redo_runs or target.key in redo_evaluations
             or not evaluation_file(study, target).is_file()]
    model = {run.run_id: run.model for run in study.runs}
    by_key = {target.key: target for target in evals}
    return runs, evals, model.get, lambda key: (model[by_key[key].run], by_key[key].suite)


def ledger(study: Study, rule: str) -> Path:
    return study.results / JOBS / rule


def _read(path: Path) -> tuple[list[str], list[str]] | None:
    """A recorded bundle's members and those pending when it was last planned (a record without them,
    from an older klstudy: all of its members)."""
    try:
        record = json.loads(path.read_text())
        members = record["members"]
        pending = record.get("pending", members)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # torn by a hard kill: its members are planned again
    if not all(isinstance(items, list) and all(isinstance(m, str) for m in items) for items in (members, pending)):
        return None
    return members, pending


def _recorded(study: Study, rule: str) -> list[Bundle]:
    """Every recorded bundle, as the main process last planned it."""
    directory = ledger(study, rule)
    if study.bundle[rule] == 1 or not directory.is_dir():
        return []
    found = [(path.stem, _read(path)) for path in sorted(directory.glob("*.json"))]
    return [Bundle(rule, key, tuple(read[0]), tuple(read[1])) for key, read in found if read and read[1]]


def _bundles(study: Study, rule: str, pending: list[str], group_of: Callable[[str], Hashable],
             record: bool) -> list[Bundle]:
    """Recorded bundles that still fit the study (each member pending in one group, no more than
    `bundle.<rule>` of them), then new bundles of the pending items no kept bundle holds. With `record`,
    the ledger is left holding exactly these."""
    size, directory = study.bundle[rule], ledger(study, rule)
    if size == 1:  # a job per item, named by the rule's wildcard: no bundle is recorded
        if record and directory.is_dir():
            for path in directory.glob("*.json"):
                path.unlink()
        return []
    position = {item: i for i, item in enumerate(pending)}
    kept, taken, stale = [], set(), []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        members = (_read(path) or ([], []))[0]
        left = [m for m in members if m in position and m not in taken]
        if left and len(left) <= size and len({group_of(m) for m in left}) == 1:
            kept.append(Bundle(rule, path.stem, tuple(members), tuple(sorted(left, key=position.get))))
            taken.update(left)
        else:
            stale.append(path)
    groups: dict[Hashable, list[str]] = {}
    for item in pending:
        if item not in taken:
            groups.setdefault(group_of(item), []).append(item)
    new = [tuple(items[i:i + size]) for items in groups.values() for i in range(0, len(items), size)]
    fresh = [Bundle(rule, _key(rule, members), members, members) for members in new]
    if record:
        for path in stale:
            path.unlink(missing_ok=True)
        for bundle in kept + fresh:  # a job's own process reads its members pending now from here
            _write(directory / f"{bundle.key}.json", bundle)
    return _in_order(kept + fresh, pending, group_of)


def _in_order(bundles: list[Bundle], pending: list[str], group_of: Callable[[str], Hashable]) -> list[Bundle]:
    """Group by group (in the order the grid first meets them), then in grid order."""
    position = {item: i for i, item in enumerate(pending)}
    rank = {group: i for i, group in enumerate(dict.fromkeys(group_of(item) for item in pending))}
    return sorted(bundles, key=lambda bundle: (rank[group_of(bundle.pending[0])], position[bundle.pending[0]]))


def _key(rule: str, members: tuple[str, ...]) -> str:
    return hashlib.sha256(json.dumps([rule, *members]).encode()).hexdigest()[:10]


def _write(path: Path, bundle: Bundle) -> None:
    text = json.dumps({"members": list(bundle.members), "pending": list(bundle.pending)}) + "\n"
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def only(items: list[str]) -> str:
    """A wildcard constraint that matches exactly these items (none: nothing)."""
    return "|".join(re.escape(item) for item in items) or "(?!)"
