"""Read what training and evaluation wrote: run directories are the source of truth."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.run_files import COMPLETE, CONFIG, METRICS, read_metrics


@dataclass
class RunRecord:
    """One grid point: its id, config, grid coordinates, per-step metrics and eval scores."""

    run_id: str
    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # suite -> eval metrics.json

    @property
    def eval_root(self) -> Path:
        """results/eval/<run id>: one directory per evaluated suite."""
        return self.path.parent.parent / "eval" / self.run_id

    @property
    def complete(self) -> bool:
        return (self.path / COMPLETE).exists()

    @property
    def coords(self) -> dict[str, Any]:
        """The grid coordinates: model, estimator, placement, beta (None without KL), seed."""
        objective = self.config.get("objective", {})
        placement = objective.get("placement", "none")
        return {
            "model": Path(str(self.config.get("model", {}).get("path", ""))).name or "?",
            "estimator": objective.get("estimator") if placement != "none" else None,
            "placement": placement,
            "beta": objective.get("beta") if placement != "none" else None,
            "seed": self.config.get("train", {}).get("seed", 0),
        }

    @property
    def label(self) -> str:
        c = self.coords
        return "no KL" if c["placement"] == "none" else f"{c['estimator']}-{c['placement']}"

    def scores(self) -> dict[str, float]:
        """Eval pass@1 per task (over all suites)."""
        return {task: row["value"] for suite in self.evals.values() for task, row in suite.get("tasks", {}).items()}


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def load_runs(results: Path) -> list[RunRecord]:
    """Every run under results/runs that has a config, with its evals from results/eval/<id>/<suite>."""
    runs_dir = Path(results) / "runs"
    records = []
    for path in sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []:
        config_file = path / CONFIG
        if not config_file.is_file():
            continue
        record = RunRecord(path.name, path, yaml.safe_load(config_file.read_text()) or {},
                           read_metrics(path / METRICS))
        eval_root = record.eval_root
        for suite in sorted(eval_root.iterdir()) if eval_root.is_dir() else []:
            if (suite / "metrics.json").is_file():
                record.evals[suite.name] = json.loads((suite / "metrics.json").read_text())
        records.append(record)
    return records
