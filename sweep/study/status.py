"""Where every grid point of a study stands, read from its run directory alone (no scheduler, no server).

- changed: its run or some of its evaluations were made otherwise than the study says now (sweep.study.changes),
  with the keys: `--config rerun=changed` runs exactly those again.
- done: the trainer wrote COMPLETE; with how many of its evaluations are done.
- failed: its last attempt wrote FAILED, with the reason, the step and its log (the run's train.log).
- running: a trainer holds its lease now (trainer.lease): who (pid, host, SLURM job), its heartbeat's
  age, the last step it logged.
- pending: none of these; a run interrupted mid-way says the last step it logged (it resumes from its
  newest checkpoint).

`python -m sweep status` prints it; with `--json`, each point also with its config digest (trainer.config.digest),
the one its run's COMPLETE, its MLflow run (tag klstudy.config_digest) and the report's provenance.csv carry.
It reads a few small files per point, so it answers in well under two seconds for a study of hundreds of
points (docs/guides/resuming.md has the measurement).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sweep.study import changes, jobs
from sweep.study.grid import Study
from trainer.config import TrainConfig
from trainer.lease import current_holder, seems_alive
from trainer.run_files import COMPLETE, METRICS, count_lines, read_failure

STATES = ("changed", "done", "failed", "running", "pending")


@dataclass(frozen=True)
class PointStatus:
    run_id: str
    state: str                     # changed | done | failed | running | pending
    step: int                      # steps logged in metrics.jsonl
    steps: int                     # steps the run trains
    evaluations_done: int
    evaluations: int
    detail: dict[str, Any]         # failed: reason, step, log; running: holder and heartbeat age
    digest: str                    # the run's identity (trainer.config.digest): its COMPLETE's, MLflow's tag

    def line(self, width: int = 0) -> str:
        evals = f"evaluations {self.evaluations_done}/{self.evaluations}"
        if self.state == "changed":
            say = (f"{', '.join(self.detail['outputs'])} made otherwise than the study says now "
                   f"({changes.keys_text(self.detail['keys'])})")
        elif self.state == "done":
            say = f"{self.steps}/{self.steps} steps, {evals}"
        elif self.state == "failed":
            say = f"at step {self.detail.get('step')}: {self.detail.get('reason')}  log: {self.detail.get('log')}"
        elif self.state == "running":
            job = f", SLURM job {self.detail['slurm_job']}" if self.detail.get("slurm_job") else ""
            say = (f"step {self.step}/{self.steps}, pid {self.detail.get('pid')} on {self.detail.get('host')}{job}, "
                   f"heartbeat {self.detail['heartbeat_age_s']:.0f} s ago")
        else:
            say = f"step {self.step}/{self.steps} logged, resumes" if self.step else "not started"
        return f"  {self.state:8s} {self.run_id:{width}s}  {say}"


def point_status(study: Study, run_id: str, evaluations: list[jobs.EvalTarget], now: float,
                 survey: changes.Survey | None = None) -> PointStatus:
    run_dir, spec = study.results / "runs" / run_id, study.run(run_id)
    steps = spec.config.get("train", {}).get("steps", TrainConfig.steps)
    done_evals = sum(jobs.evaluation_file(study, target).is_file() for target in evaluations)
    base = dict(run_id=run_id, steps=steps, evaluations_done=done_evals, evaluations=len(evaluations),
                digest=spec.digest)
    outputs = survey.outputs_of(run_id) if survey is not None else []
    if outputs:
        return PointStatus(state="changed", step=count_lines(run_dir / METRICS),
                           detail={"outputs": [change.output for change in outputs],
                                   "keys": {key: values for change in outputs for key, values in change.keys.items()}},
                           **base)
    if (run_dir / COMPLETE).is_file():
        return PointStatus(state="done", step=steps, detail={}, **base)
    step = count_lines(run_dir / METRICS)
    holder = current_holder(run_dir)
    if holder is not None and seems_alive(holder, now):
        detail = {key: holder.get(key) for key in ("pid", "host", "slurm_job", "started")}
        detail["heartbeat_age_s"] = round(now - float(holder.get("heartbeat", now)), 1)
        return PointStatus(state="running", step=step, detail=detail, **base)
    failure = read_failure(run_dir)
    if failure is not None:
        return PointStatus(state="failed", step=step, detail=failure, **base)
    return PointStatus(state="pending", step=step, detail={}, **base)


def study_status(study: Study) -> list[PointStatus]:
    """Every grid point's status, in grid order."""
    by_run: dict[str, list[jobs.EvalTarget]] = {}
    for target in jobs.evaluations(study):
        by_run.setdefault(target.run, []).append(target)
    now, survey = time.time(), changes.survey(study)
    return [point_status(study, run.run_id, by_run.get(run.run_id, []), now, survey) for run in study.runs]


def counts(points: list[PointStatus]) -> dict[str, int]:
    return {state: sum(point.state == state for point in points) for state in STATES}


def report(study: Study, points: list[PointStatus], only: tuple[str, ...] = ()) -> list[str]:
    """The printed status: counts, one line per point (of the states in `only`, else all), what to do next."""
    number = counts(points)
    lines = [f"study {study.name} ({Path(study.results)}/): {len(points)} points: "
             + ", ".join(f"{number[state]} {state}" for state in STATES)]
    shown = [point for point in points if not only or point.state in only]
    width = max((len(point.run_id) for point in shown), default=0)
    lines += [point.line(width) for point in shown]
    if number["changed"]:
        lines.append("run the changed outputs again from scratch: your snakemake command with --config "
                     f"rerun=changed (the old outputs are moved to {Path(study.results) / 'discarded'}/), or restore "
                     "the study config")
    if number["failed"]:
        lines.append("rerun the failed points from scratch: your snakemake command with --config rerun=failed "
                     f"(their outputs are moved to {Path(study.results) / 'discarded'}/)")
    return lines


def records(points: list[PointStatus]) -> list[dict[str, Any]]:
    return [asdict(point) for point in points]
