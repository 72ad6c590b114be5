"""A study config -> the runs of its grid, each with a stable readable id and a validated run config.

The Snakefile calls `load_study` before it builds the DAG, so a bad study config stops everything
before any job starts, with a `StudyError` whose message starts with the offending key. A study is
validated once: by the study schema (sweep.study.study_schema: shape, types, allowed names, defaults), then
here for what a schema cannot say (the grid's points, every run's trainer config: `trainer.config`
needs no torch, so this stays fast).

Axes: model, estimator, placement, beta and seed, and any run-config key in `grid.axes` (dotted,
such as `train.async_level`), all multiplied. A point runs once however many values an axis has
that it does not use: the no-KL baseline has no estimator, beta or KL loss ratio, and the KL in the
reward has no KL loss ratio (sweep.study.points).

Run ids: `<model>__<estimator>-<placement>__b<beta>[__<extra>...]__s<seed>`, and
`<model>__none[__<extra>...]__s<seed>` for the baseline. An extra axis appears (`async2`,
`ratio-detached`) only where the run's value differs from the study's base value (its `run` config,
else the trainer's default), so that adding an axis or a value to a study renames no run: a sweep
started before resumes and runs only the new points.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sweep.study.checks import StudyError, mapping, merge
from sweep.study.config_schema import schema_problem
from sweep.study.points import Expansion, Point, run_id
from sweep.study.study_schema import default, defaults

__all__ = ["ModelSpec", "RunSpec", "Study", "StudyError", "load_study", "run_id"]

log = logging.getLogger(__name__)

RULES = ("prepare", "train", "evaluate", "track", "report")
BUNDLED = ("train", "evaluate")  # rules whose jobs may each take several grid points, in one process
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class RunSpec:
    """One grid point: its id, coordinates (sweep.study.axes: model, estimator, placement, beta, the extra
    axes, seed; None where unused) and the full trainer config (nested, plain data). `sources`: for each
    run-config key the study sets (`train.lr`), the study key that set it (`models.qwen.run.train.lr`,
    `grid.axes.train.lr`, `grid.betas`, `evaluate.every`); a key absent from it is the trainer's default."""

    run_id: str
    coords: dict[str, Any]
    config: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def source(self, key: str) -> str | None:
        """The study key that set run-config `key` (`train.adam_betas[0]`: its list's), None for a default;
        a key that an objective preset filled in is the preset's."""
        base, bracket, rest = key.partition("[")
        found = self.sources.get(base)
        if found is None and base.startswith("objective.") and "objective.preset" in self.sources:
            found = self.sources["objective.preset"]
        return None if found is None else found + bracket + rest

    @property
    def digest(self) -> str:
        """The run's identity (trainer.config.digest): what its COMPLETE records once it is trained."""
        from trainer.config import digest, from_dict

        return digest(from_dict(self.config))

    @property
    def model(self) -> str:
        return self.coords["model"]

    @property
    def seed(self) -> int:
        return self.coords["seed"]

    def overrides(self) -> list[str]:
        """The config as `section.key=value` arguments of `python -m trainer train` (values as JSON,
        which the trainer reads as YAML)."""
        return [f"{section}.{key}={json.dumps(value)}"
                for section, values in self.config.items() for key, value in values.items()]


@dataclass(frozen=True)
class ModelSpec:
    """A base model: a local path or hub id, built here (`build: toy`: the tiny model + SFT), or imported
    here from a GGUF file (`gguf`: {file} or a wheel's {wheel, member})."""

    name: str
    path: str
    build: dict[str, Any] | None
    run: dict[str, Any]
    resources: dict[str, dict[str, Any]]
    gguf: dict[str, str] | None = None

    @property
    def prepared(self) -> bool:
        """Whether the prepare step writes the model (into <results>/models/<stem>)."""
        return self.build is not None or self.gguf is not None

    @property
    def stem(self) -> str:
        """Its files' name under <results>/models: a prepared model's carries the digest of how it is made, so
        that a changed build or import is a new model, prepared anew, and the runs trained from the old one
        say so (their model.path: sweep.study.changes)."""
        return f"{self.name}.{spec_digest({'build': self.build, 'gguf': self.gguf})}" if self.prepared else self.name


@dataclass(frozen=True)
class Study:
    name: str
    results: Path
    models: dict[str, ModelSpec]
    runs: list[RunSpec]
    data: dict[str, dict[str, Any]]       # name -> export spec, written to data_file(name)
    evaluate: dict[str, Any]
    tracking_uri: str | None
    resources: dict[str, dict[str, Any]]  # rule -> resources (defaults merged in)
    bundle: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUNDLED, 1))
    budget: dict[str, Any] = field(default_factory=lambda: defaults("budget"))  # sweep.study.budget's estimates
    by_id: dict[str, RunSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_id.update({run.run_id: run for run in self.runs})

    def run(self, run_id: str) -> RunSpec:
        return self.by_id[run_id]

    def model_dir(self, model: str) -> Path:
        """Where `prepare` writes a built or imported model (ModelSpec.stem)."""
        return self.results / "models" / self.models[model].stem

    def model_ready(self, model: str) -> Path:
        """The marker `prepare` writes last; training waits for it."""
        return self.results / "models" / f"{self.models[model].stem}.ready"

    def data_file(self, name: str) -> Path:
        """Where `prepare` writes a data set: named by its spec too (`<name>.<digest>.jsonl`), so that a changed
        spec is a new file, prepared anew, and an evaluation of the old one records another source."""
        return self.results / "data" / f"{name}.{spec_digest(self.data[name])}.jsonl"

    def eval_steps(self, run_id: str) -> list[int]:
        """The checkpoint steps to evaluate besides the final model (every N-th, when asked)."""
        from trainer.config import TrainConfig

        every = self.evaluate["every"]
        steps = self.run(run_id).config.get("train", {}).get("steps", TrainConfig.steps)
        return list(range(every, steps, every)) if every else []

    def bundles(self, rule: str, items: list[Any], model_of=lambda item: item) -> list[list[Any]]:
        """`items` (run ids, or evaluations keyed by run id) in jobs of `bundle.<rule>` each: a job never
        mixes models (they may differ in resources and settings); within a model, in grid order."""
        size, by_model = self.bundle[rule], {}
        for item in items:
            by_model.setdefault(self.run(model_of(item)).model, []).append(item)
        return [group[i:i + size] for group in by_model.values() for i in range(0, len(group), size)]

    def eval_data(self) -> dict[str, str]:
        """TASK -> data source: a prepared data set's file, or the path / hub id as given."""
        return {task: str(self.data_file(source)) if source in self.data else source
                for task, source in self.evaluate["data"].items()}

    def resources_for(self, rule: str, model: str | None = None) -> dict[str, Any]:
        """A rule's resources; a model's own `resources` entry wins for its train and evaluate jobs."""
        merged = dict(self.resources[rule])
        if model is not None:
            merged.update(self.models[model].resources.get(rule, {}))
        return merged


def spec_digest(spec: Any) -> str:
    """Eight hex digits of a spec's JSON: what the prepare step makes is named by what it is made from."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _models(data: dict[str, Any]) -> dict[str, ModelSpec]:
    """The study's models (their shape checked by the schema): a name may not hold the run ids' '__'."""
    models = {}
    for name, entry in data["models"].items():
        key = f"models.{name}"
        if not isinstance(name, str) or not _NAME.match(name) or "__" in name:
            raise StudyError(f"{key}: a model name may hold letters, digits and . _ + - (not '__')")
        models[name] = ModelSpec(name, entry.get("path", ""), entry.get("build"), entry.get("run") or {},
                                 entry.get("resources") or {}, entry.get("gguf"))
    return models


def _model_config(shared: dict[str, Any], model: ModelSpec, results: str, every: int) -> dict[str, Any]:
    """What the study sets for every run of `model`, before the grid's coordinates."""
    path = str(Path(results) / "models" / model.stem) if model.prepared else model.path
    return _for_evaluation(merge(merge(shared, model.run), {"model": {"path": path, "name": model.name}}), every)


def _for_evaluation(config: dict[str, Any], every: int) -> dict[str, Any]:
    """With evaluate.every: the checkpoints to evaluate outlive checkpoint.keep, and get their objective
    measured."""
    if not every:
        return config
    config = merge(config, {"checkpoint": {"keep_every": every}})
    if config.get("measure", {}).get("prompts") and not config["measure"].get("every"):
        config = merge(config, {"measure": {"every": every}})
    return config


def _complete(config: dict[str, Any]) -> dict[str, Any]:
    """A run config as the trainer completes it (defaults filled in, values as it reads them); an invalid
    one with the defaults under it (its runs' own check says what is wrong)."""
    from trainer.config import ConfigError, RunConfig, from_dict

    try:
        return from_dict(config).to_dict()
    except ConfigError:
        return merge(RunConfig().to_dict(), config)


def _check_run_config(config: dict[str, Any], run: RunSpec, axes: list[str]):
    """One run's validated trainer config; an error names the study key that set the bad value (its
    `sources`; `run.` for a trainer default the study's combination made bad), and for an axis the
    first run with the bad combination. The error's key is data: nothing is parsed from its text."""
    from trainer.config import ConfigError, from_dict

    try:
        return from_dict(config)
    except ConfigError as error:
        where = run.source(error.key) or f"run.{error.key}"
        axis = error.key.partition("[")[0] in axes or where.startswith("grid.axes.")
        raise StudyError(f"{where}: {error.message}" + (f" (in run {run.run_id})" if axis else "")) from None


_STANDARD_AXES = {"objective.estimator": "grid.estimators", "objective.placement": "grid.placements",
                  "objective.beta": "grid.betas", "train.seed": "grid.seeds"}


def _sources(shared: dict[str, Any], model: ModelSpec, axes: list[str], every: int) -> dict[str, str]:
    """Which study key sets each run-config key of `model`'s runs (RunSpec.sources), the later winning as
    the configs merge: the study's `run`, the model's `run`, the model itself, the grid's axes, evaluate.every.
    The standard axes are each point's own (_point_sources)."""
    found = {}
    for origin, config in (("run", shared), (f"models.{model.name}.run", model.run)):
        for section, values in config.items():
            for key in values if isinstance(values, dict) else ():
                found[f"{section}.{key}"] = f"{origin}.{section}.{key}"
    found.update({"model.path": f"models.{model.name}", "model.name": f"models.{model.name}"})
    found.update({key: f"grid.axes.{key}" for key in axes})
    if every:
        found["checkpoint.keep_every"] = "evaluate.every"
        found.setdefault("measure.every", "evaluate.every")
    return found


def _point_sources(model_sources: dict[str, str], point: Point) -> dict[str, str]:
    """`model_sources` with the keys the point itself sets: the grid's lists (an objective preset's estimator and
    placement its own), the baseline's placement `grid.baseline`, an include entry's every value that entry."""
    if point.origin.startswith("grid.include"):
        keys = _STANDARD_AXES if point.placement != "none" else ("objective.placement", "train.seed")
        own = dict.fromkeys(keys, point.origin)
        return {**model_sources, **own, **{key: f"{point.origin}.{key}" for key in point.extra}}
    if point.placement == "none" and point.origin == "grid.baseline":
        return {**model_sources, "objective.placement": point.origin, "train.seed": "grid.seeds"}
    own = dict(_STANDARD_AXES) if point.placement != "none" else {"train.seed": "grid.seeds"}
    if "objective.preset" in model_sources:
        own.update({key: model_sources["objective.preset"] for key in ("objective.estimator", "objective.placement")})
    return {**model_sources, **own}


def _data(raw: Any) -> dict[str, dict[str, Any]]:
    data = {}
    for name, spec in mapping(raw, "data").items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise StudyError(f"data.{name}: a data set name may hold letters, digits and . _ + -")
        data[name] = {**defaults("data", "*"), **spec}
    return data


def _evaluate(spec: dict[str, Any], data: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`evaluate` with its defaults; each task's data source checked against the study's data sets."""
    from eval.suites import NEEDS_DATA, TASKS, expand

    merged = {**defaults("evaluate"), **spec}
    sources = merged["data"]
    for task, source in sources.items():
        if task not in TASKS:
            raise StudyError(f"evaluate.data.{task}: no such task ({', '.join(TASKS)})")
        if not source:
            raise StudyError(f"evaluate.data.{task}: expected a data set name from `data`, a file or a hub id")
        if source not in data and source.endswith((".jsonl", ".json", ".parquet")) and not Path(source).exists():
            log.warning("evaluate.data.%s: %s does not exist (yet); evaluating %s will fail until it does",
                        task, source, task)
    for task in expand(merged["suites"]):  # every name was checked by the schema
        if task in NEEDS_DATA and task not in sources:
            raise StudyError(f"evaluate.data.{task}: required, since {task} has no public default data set")
    return merged


def load_study(data: dict[str, Any], schema_file: Path | None = None) -> Study:
    """The validated study described by a parsed study config (`schema_file`: the study schema's, if not
    workflow/config/schema.yaml)."""
    data = mapping(data, "config")
    # The axes' values are run-config values: sweep.study.points checks them against the trainer's config.
    problem = schema_problem(data, schema_file, left_to=("grid.axes",))
    if problem is not None:
        raise StudyError(problem)
    name = data["study"]
    results = data.get("results") or f"results/{name}"  # one directory per study (sweep.study.owner)
    models = _models(data)
    grid = mapping(data.get("grid"), "grid")
    shared = mapping(data.get("run"), "run")
    for key in ("path", "name"):
        if key in mapping(shared.get("model"), "run.model"):
            raise StudyError(f"run.model.{key}: set by the study from `models` (a model's key is its name)")
    study_data = _data(data.get("data"))
    evaluate = _evaluate(data["evaluate"], study_data)
    tracking = mapping(data.get("tracking"), "tracking")
    resources_raw = mapping(data.get("resources"), "resources")
    base = {**default("resources", "default"), **resources_raw.get("default", {})}
    resources = {rule: {**base, **resources_raw.get(rule, {})} for rule in RULES}

    every = evaluate["every"]
    partial = {name: _model_config(shared, model, results, every) for name, model in models.items()}
    expansion = Expansion(grid, {name: _complete(config) for name, config in partial.items()})
    sources = {name: _sources(shared, model, expansion.names, every) for name, model in models.items()}
    runs, validated = [], {}
    for point in expansion.points():
        model = models[point.model]
        config = _for_evaluation(merge(partial[point.model], point.overrides()), every)
        # Runs that differ only in estimator, beta and seed validate alike: check one each.
        shape = json.dumps({**config, "objective": {**config["objective"], "estimator": None, "beta": None},
                            "train": {**config["train"], "seed": None}}, sort_keys=True, default=str)
        coords = {"model": point.model, "estimator": point.estimator, "placement": point.placement,
                  "beta": point.beta, **{key: expansion.value(point, key) for key in expansion.names},
                  "seed": point.seed}
        run = RunSpec(point.run_id, coords, config, _point_sources(sources[point.model], point))
        if shape not in validated:
            validated[shape] = _check_run_config(config, run, expansion.names)
        checked = validated[shape]
        if every % checked.checkpoint.every:
            raise StudyError(f"evaluate.every: {every} is not a multiple of run.checkpoint.every "
                             f"({checked.checkpoint.every}), so those steps have no checkpoint to evaluate")
        for inert in checked.objective.inert_fields():
            if f"objective.{inert}" in coords:
                coords[f"objective.{inert}"] = None
        runs.append(run)
    if not runs:
        raise StudyError("grid: selects no runs (check estimators, placements, betas, baseline and exclude)")
    ids = [r.run_id for r in runs]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise StudyError(f"grid: two grid points share the run id {duplicate} (values that print alike, such as "
                         "the betas 0.1 and 0.10000000001)")
    budget = {**defaults("budget"), **mapping(data.get("budget"), "budget")}
    per_model = budget.get("step_seconds")
    for model in per_model if isinstance(per_model, dict) else ():
        if model not in models:
            raise StudyError(f"budget.step_seconds.{model}: not a model of the study ({', '.join(models)})")
    return Study(name, Path(results), models, runs, study_data, evaluate, tracking.get("uri"), resources,
                 {**defaults("bundle"), **mapping(data.get("bundle"), "bundle")}, budget)
