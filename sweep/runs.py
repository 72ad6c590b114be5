"""Read what training and evaluation wrote: run directories are the source of truth."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eval import provenance
from eval.harness import METRICS_FILE
from sweep.study import axes
from trainer.config import ConfigError, digest, from_dict
from trainer.run_files import COMPLETE, CONFIG, METRICS, OBJECTIVE, OBJECTIVE_REFERENCE, read_metrics


@dataclass(frozen=True)
class Evaluation:
    """One evaluated suite of one model (the final one or a checkpoint's), as load_runs read it."""

    step: int           # the training step whose model was evaluated
    suite: str
    where: str          # its directory under results/eval/<run id>: <suite> or step_<N>/<suite>
    directory: Path
    scores: dict[str, Any]  # its metrics.json

    @property
    def digest(self) -> str | None:
        """What made it, as one sha256 (eval.provenance.digest); None for one made before klstudy recorded it."""
        made = self.scores.get("provenance")
        return provenance.digest(made) if isinstance(made, dict) else None


@dataclass
class RunRecord:
    """One grid point: its id, config, grid coordinates, per-step metrics and eval scores."""

    run_id: str
    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # suite -> eval metrics.json
    checkpoint_evals: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)  # step -> suite -> ...
    objective: list[dict[str, Any]] = field(default_factory=list)  # objective.jsonl: the measured objective
    objective_reference: dict[str, Any] | None = None  # objective_reference.json: the reference's rewards
    extra_axes: tuple[str, ...] = ()  # the run-config keys its study swept besides the standard axes

    @property
    def eval_root(self) -> Path:
        """results/eval/<run id>: one directory per evaluated suite."""
        return self.path.parent.parent / "eval" / self.run_id

    def evaluations(self) -> list[Evaluation]:
        """Every evaluation: the final model's at the run's last step, then the kept checkpoints'
        (results/eval/<id>/step_<N>/<suite>) at their own steps."""
        final = [Evaluation(len(self.metrics), suite, suite, self.eval_root / suite, scores)
                 for suite, scores in self.evals.items()]
        return final + [Evaluation(step, suite, f"step_{step}/{suite}", self.eval_root / f"step_{step}" / suite, scores)
                        for step, suites in sorted(self.checkpoint_evals.items()) for suite, scores in suites.items()]

    @property
    def complete(self) -> bool:
        return (self.path / COMPLETE).exists()

    @functools.cached_property
    def config_digest(self) -> str | None:
        """The run's identity (trainer.config.digest) from its config.yaml, with the keys klstudy added since
        at their defaults; None for a config that no longer validates."""
        try:
            return digest(from_dict(self.config))
        except ConfigError:
            return None

    @property
    def coords(self) -> dict[str, Any]:
        """The grid coordinates: model, estimator, placement, beta, the extra axes, seed (None where
        the run does not use one: no estimator or beta without KL)."""
        return axes.coords_of(self.config, self.extra_axes)

    @property
    def label(self) -> str:
        return axes.configuration(self.coords)

    @property
    def final_beta(self) -> float | None:
        """The beta of the run's last measurement (an adaptive beta moves; the objective line records it),
        else its coordinate."""
        if self.coords["beta"] is None:
            return None
        return self.objective[-1].get("beta", self.coords["beta"]) if self.objective else self.coords["beta"]

    def measured(self, beta: float | None) -> dict[str, float] | None:
        """The final model's measured objective: reward and KL to the reference, and at `beta` (any
        beta, not only the run's own) the objective, its optimum and the gap, each with its standard
        error; None when the run measured nothing at its last step."""
        if not self.objective or self.objective[-1]["step"] != len(self.metrics) or self.objective_reference is None:
            return None
        from trainer.measure.optimum import mean_se, objective_gap

        per_prompt = self.objective[-1]["per_prompt"]
        if beta is None:
            return {name: value for key in ("reward", "kl") for name, value in
                    zip((key, f"{key}_se"), mean_se(per_prompt[key]), strict=True)}
        return objective_gap(self.objective_reference["histograms"], per_prompt["reward"], per_prompt["kl"], beta)

    def scores(self) -> dict[str, float]:
        """Eval pass@1 per task (over all suites)."""
        return {task: row["value"] for suite in self.evals.values() for task, row in suite.get("tasks", {}).items()}


def _suites(directory: Path) -> dict[str, dict[str, Any]]:
    """suite -> its metrics.json, for every suite evaluated under `directory`."""
    if not directory.is_dir():
        return {}
    return {suite.name: json.loads((suite / METRICS_FILE).read_text())
            for suite in sorted(directory.iterdir()) if (suite / METRICS_FILE).is_file()}


def read_config(path: Path) -> dict[str, Any]:
    """A run's config.yaml, with libyaml's parser where PyYAML has it (100 times faster: a live follower
    reads its runs' configs every round)."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}


def _run_dirs(results: Path) -> list[Path]:
    runs_dir = Path(results) / "runs"
    return sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []


def study_axes(results: Path) -> tuple[str, ...]:
    """The extra axes of the runs under `results` (see load_runs), from their configs alone."""
    return tuple(axes.extra_axes([read_config(path / CONFIG) for path in _run_dirs(results)
                                  if (path / CONFIG).is_file()]))


def load_runs(results: Path, only: list[Path] | None = None) -> list[RunRecord]:
    """Every run under results/runs that has a config (or those of the run directories `only`), with its
    evals from results/eval/<id>/<suite>; the extra axes are the config keys that differ between runs
    of one model (sweep.study.axes), and unknown with `only`."""
    records = []
    for path in _run_dirs(results) if only is None else [Path(p) for p in only]:
        config_file = path / CONFIG
        if not config_file.is_file():
            continue
        record = RunRecord(path.name, path, read_config(config_file),
                           read_metrics(path / METRICS), objective=read_metrics(path / OBJECTIVE))
        if (path / OBJECTIVE_REFERENCE).is_file():
            record.objective_reference = json.loads((path / OBJECTIVE_REFERENCE).read_text())
        record.evals = _suites(record.eval_root)
        for directory in sorted(record.eval_root.glob("step_*")):
            if directory.name[5:].isdigit() and (suites := _suites(directory)):
                record.checkpoint_evals[int(directory.name[5:])] = suites
        records.append(record)
    extra = tuple(axes.extra_axes([r.config for r in records])) if only is None else ()
    for record in records:
        record.extra_axes = extra
    return records
