"""What a study needs from the Hugging Face hub, and whether this node's cache already holds it.

Compute jobs run offline (sweep.hub.job_env), so every hub model and data set a job reads must be in the
shared cache before the first job starts: the models given by hub id, the math task's hub data set
(training, the held-out measure, a `data:` entry), and each evaluation task's data set where the
study gives a hub id or none (lm-eval's default: eval/tasks/<task>.yaml). The cache checks read
files only (no network, no `datasets` import), so the preflight of every Snakemake run can afford them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from eval.data import is_local as is_local_data
from eval.suites import expand
from trainer.model import model_source

TASKS_DIR = Path(__file__).resolve().parents[2] / "eval" / "tasks"


@dataclass(frozen=True)
class Need:
    """A hub model or data set (`subset`: the data set's config name) and the study key that names it."""

    kind: str  # "model" or "dataset"
    hub_id: str
    subset: str | None
    key: str

    def __str__(self) -> str:
        return f"{self.kind} {self.hub_id}{f':{self.subset}' if self.subset else ''}"


def needs(study) -> list[Need]:
    """Every hub model and data set the study's jobs read, once each, in the study's order."""
    found: dict[tuple, Need] = {}
    for need in (*_models(study), *_task_data(study), *_eval_data(study)):
        found.setdefault((need.kind, need.hub_id, need.subset), need)
    return list(found.values())


def cached(need: Need) -> bool:
    """Whether this node's cache holds `need` in the form the offline jobs load."""
    if need.kind == "model":
        return model_source.in_hub_cache(need.hub_id)
    return _dataset_cached(need.hub_id, need.subset)


def _models(study) -> Iterator[Need]:
    for name, model in study.models.items():
        if not model.prepared and not model_source.is_local(model.path):
            yield Need("model", model.path, None, f"models.{name}.path")


def _math_source(options: dict[str, Any], key: str) -> Iterator[Need]:
    path = options.get("path")
    if isinstance(path, str) and not is_local_data(path):
        yield Need("dataset", path, options.get("subset"), key)


def _task_data(study) -> Iterator[Need]:
    for run in study.runs:
        task = run.config.get("task", {})
        if task.get("name") == "math":
            options = task.get("options", {})
            yield from _math_source(options, "run.task.options.path")
            measure = run.config.get("measure", {})
            if measure.get("prompts"):
                yield from _math_source({**options, **measure.get("task_options", {})}, "run.measure.task_options.path")
    for name, spec in study.data.items():
        if spec["task"] == "math":
            yield from _math_source(spec["options"], f"data.{name}.options.path")


def _eval_data(study) -> Iterator[Need]:
    given = study.evaluate["data"]
    for task in expand(study.evaluate["suites"]):
        source = given.get(task)
        if source is None:
            spec = yaml.safe_load((TASKS_DIR / f"{task}.yaml").read_text().replace("!function", ""))
            if spec.get("dataset_path") not in (None, "json", "parquet"):
                yield Need("dataset", spec["dataset_path"], spec.get("dataset_name"), f"evaluate.suites ({task})")
        elif source not in study.data and not is_local_data(source):
            path, _, subset = source.partition(":")
            yield Need("dataset", path, subset or None, f"evaluate.data.{task}")


def datasets_cache() -> Path:
    """Where `datasets` keeps what it prepared (its offline mode loads from there)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "datasets"


def _dataset_cached(hub_id: str, subset: str | None) -> bool:
    """`datasets` keeps ORG/NAME's config C under <cache>/ORG___name/C/<version>/<commit>/ (the name
    lower-cased); offline it loads the newest there."""
    root, wanted = datasets_cache(), hub_id.replace("/", "___").lower()
    if not root.is_dir():
        return False
    for entry in root.iterdir():
        if entry.name.lower() == wanted and any((entry / (subset or "default")).glob("*/*/dataset_info.json")):
            return True
    return False
