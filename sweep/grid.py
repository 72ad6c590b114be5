"""A study config -> the runs of its grid, each with a stable readable id and a validated run config.

The Snakefile calls `load_study` before it builds the DAG, so a bad study config stops everything
before any job starts, with a `StudyError` whose message starts with the offending key. Every run's
trainer config is validated here too (`trainer.config` needs no torch, so this stays fast).

Run ids: `<model>__<estimator>-<placement>__b<beta>__s<seed>`, and `<model>__none__s<seed>` for the
no-KL baseline (beta means nothing without a KL term, so there is one baseline per model and seed).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.choices import ESTIMATORS, PLACEMENTS, TASK_NAMES

log = logging.getLogger(__name__)

RULES = ("prepare", "train", "evaluate", "track", "report")
RESOURCE_KEYS = ("cpus", "mem_mb", "runtime", "gpus", "slurm_partition", "slurm_account", "slurm_qos",
                 "constraint", "nodes", "tasks")
GRID_KEYS = ("model", "estimator", "placement", "beta", "seed")
TOP_KEYS = ("study", "results", "models", "grid", "run", "data", "evaluate", "tracking", "resources", "bundle")
BUNDLED = ("train", "evaluate")  # rules whose jobs may each take several grid points, in one process
EVAL_KEYS = ("suites", "samples", "limit", "every", "batch_size", "max_gen_toks", "temperature", "top_p",
             "backend", "data")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


class StudyError(ValueError):
    """A bad study config; the message starts with the offending key."""


@dataclass(frozen=True)
class RunSpec:
    """One grid point: its id, coordinates and the full trainer config (nested, plain data)."""

    run_id: str
    model: str
    estimator: str | None
    placement: str
    beta: float | None
    seed: int
    config: dict[str, Any]

    def overrides(self) -> list[str]:
        """The config as `section.key=value` arguments of `python -m trainer train` (values as JSON,
        which the trainer reads as YAML)."""
        return [f"{section}.{key}={json.dumps(value)}"
                for section, values in self.config.items() for key, value in values.items()]


@dataclass(frozen=True)
class ModelSpec:
    """A base model: a local path or hub id, or built here (`build: toy`: the tiny model + SFT)."""

    name: str
    path: str
    build: dict[str, Any] | None
    run: dict[str, Any]
    resources: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Study:
    name: str
    results: Path
    models: dict[str, ModelSpec]
    runs: list[RunSpec]
    data: dict[str, dict[str, Any]]       # name -> export spec, written to <results>/data/<name>.jsonl
    evaluate: dict[str, Any]
    tracking_uri: str | None
    resources: dict[str, dict[str, Any]]  # rule -> resources (defaults merged in)
    bundle: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUNDLED, 1))
    by_id: dict[str, RunSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_id.update({run.run_id: run for run in self.runs})

    def run(self, run_id: str) -> RunSpec:
        return self.by_id[run_id]

    def model_dir(self, model: str) -> Path:
        """Where `prepare` writes a built model."""
        return self.results / "models" / model

    def model_ready(self, model: str) -> Path:
        """The marker `prepare` writes last; training waits for it."""
        return self.results / "models" / f"{model}.ready"

    def data_file(self, name: str) -> Path:
        return self.results / "data" / f"{name}.jsonl"

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


def _mapping(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise StudyError(f"{key}: expected a mapping, got {value!r}")
    return value


def _list(value: Any, key: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        value = [value]
    return value


def _known(data: dict[str, Any], allowed: tuple[str, ...], key: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        where = f"{key}.{unknown[0]}" if key else unknown[0]
        raise StudyError(f"{where}: unknown key (known: {', '.join(allowed)})")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts merged, `extra` winning; neither input is changed."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def beta_text(beta: float) -> str:
    return format(beta, "g")


def run_id(model: str, estimator: str | None, placement: str, beta: float | None, seed: int) -> str:
    if placement == "none":
        return f"{model}__none__s{seed}"
    return f"{model}__{estimator}-{placement}__b{beta_text(beta)}__s{seed}"


def _number(value: Any, key: str, integer: bool = False, minimum: float | None = None) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, str) and not integer:  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            value, ok = float(value), True
        except ValueError:
            pass
    if isinstance(value, bool) or not ok:
        raise StudyError(f"{key}: expected {'a whole number' if integer else 'a number'}, got {value!r}")
    if minimum is not None and value < minimum:
        raise StudyError(f"{key}: must be >= {minimum:g}, got {value}")
    return value


def _models(data: dict[str, Any]) -> dict[str, ModelSpec]:
    raw = _mapping(data.get("models"), "models")
    if not raw:
        raise StudyError("models: at least one model is required (a name with a path, or build: toy)")
    models = {}
    for name, entry in raw.items():
        key = f"models.{name}"
        if not isinstance(name, str) or not _NAME.match(name) or "__" in name:
            raise StudyError(f"{key}: a model name may hold letters, digits and . _ + - (not '__')")
        entry = _mapping(entry, key)
        _known(entry, ("path", "build", "run", "resources"), key)
        build = entry.get("build")
        if ("path" in entry) == (build is not None):
            raise StudyError(f"{key}: give exactly one of path (a local directory or hub id) and build")
        if build is not None:
            build = _mapping(build, f"{key}.build")
            _known(build, ("toy", "sft"), f"{key}.build")
            if "toy" not in build:
                raise StudyError(f"{key}.build.toy: required (the tiny model's spec, {{}} for the defaults)")
            _mapping(build["toy"], f"{key}.build.toy")
            sft = _mapping(build.get("sft"), f"{key}.build.sft")
            _known(sft, ("task", "options", "steps", "batch_size", "lr", "seed"), f"{key}.build.sft")
        elif not isinstance(entry["path"], str) or not entry["path"]:
            raise StudyError(f"{key}.path: expected a local directory or hub id, got {entry['path']!r}")
        resources = _mapping(entry.get("resources"), f"{key}.resources")
        for rule, values in resources.items():
            if rule not in ("train", "evaluate"):
                raise StudyError(f"{key}.resources.{rule}: only train and evaluate resources can be set per model")
            _resources(values, f"{key}.resources.{rule}")
        models[name] = ModelSpec(name, entry.get("path", ""), build, _mapping(entry.get("run"), f"{key}.run"),
                                 resources)
    return models


def _resources(values: Any, key: str) -> dict[str, Any]:
    values = _mapping(values, key)
    _known(values, RESOURCE_KEYS, key)
    for name in ("cpus", "mem_mb", "runtime", "gpus", "nodes", "tasks"):
        if name in values:
            _number(values[name], f"{key}.{name}", integer=True, minimum=0 if name == "gpus" else 1)
    return values


def _grid_points(grid: dict[str, Any], models: list[str]) -> list[tuple[str, str | None, str, float | None, int]]:
    """(model, estimator, placement, beta, seed) of every run, deduplicated, in a stable order."""
    _known(grid, ("estimators", "placements", "betas", "seeds", "baseline", "include", "exclude"), "grid")
    estimators = _list(grid.get("estimators", list(ESTIMATORS)), "grid.estimators")
    placements = _list(grid.get("placements", list(PLACEMENTS[1:])), "grid.placements")
    betas = [_number(b, f"grid.betas[{i}]", minimum=0) for i, b in enumerate(_list(grid.get("betas"), "grid.betas"))]
    seeds = [_number(s, f"grid.seeds[{i}]", integer=True, minimum=0)
             for i, s in enumerate(_list(grid.get("seeds", [0]), "grid.seeds"))]
    for i, name in enumerate(estimators):
        if name not in ESTIMATORS:
            raise StudyError(f"grid.estimators[{i}]: {name!r} is not one of {', '.join(ESTIMATORS)}")
    for i, name in enumerate(placements):
        if name not in PLACEMENTS[1:]:
            raise StudyError(f"grid.placements[{i}]: {name!r} is not one of {', '.join(PLACEMENTS[1:])} "
                             "(the no-KL baseline comes from grid.baseline)")
    if placements and estimators and not betas:
        raise StudyError("grid.betas: at least one beta is required for the KL placements")
    if not seeds:
        raise StudyError("grid.seeds: at least one seed is required")
    baseline = grid.get("baseline", True)
    if not isinstance(baseline, bool):
        raise StudyError(f"grid.baseline: expected true or false, got {baseline!r}")

    points = [(m, e, p, b, s) for m, e, p, b, s in itertools.product(models, estimators, placements, betas, seeds)]
    if baseline:
        points += [(m, None, "none", None, s) for m in models for s in seeds]
    points += _include(grid.get("include"), models)
    exclude = _patterns(grid.get("exclude"))
    points = [p for p in points if not any(_matches(p, pattern) for pattern in exclude)]
    return list(dict.fromkeys(points))


def _patterns(raw: Any) -> list[dict[str, list[Any]]]:
    patterns = []
    for i, entry in enumerate(_list(raw, "grid.exclude")):
        entry = _mapping(entry, f"grid.exclude[{i}]")
        _known(entry, GRID_KEYS, f"grid.exclude[{i}]")
        patterns.append({k: [float(x) if k == "beta" else x for x in _list(v, k)] for k, v in entry.items()})
    return patterns


def _matches(point: tuple, pattern: dict[str, list[Any]]) -> bool:
    values = dict(zip(GRID_KEYS, point, strict=True))
    return all(values[key] in allowed for key, allowed in pattern.items())


def _include(raw: Any, models: list[str]) -> list[tuple]:
    """Extra grid points; each entry may give lists, which expand as a small grid of their own."""
    points = []
    for i, entry in enumerate(_list(raw, "grid.include")):
        key = f"grid.include[{i}]"
        entry = _mapping(entry, key)
        _known(entry, GRID_KEYS, key)
        axes = {name: _list(entry.get(name), f"{key}.{name}") for name in GRID_KEYS}
        axes["model"] = axes["model"] or models
        axes["seed"] = axes["seed"] or [0]
        for name in axes["model"]:
            if name not in models:
                raise StudyError(f"{key}.model: {name!r} is not one of the study's models ({', '.join(models)})")
        for placement in axes["placement"] or [None]:
            if placement not in PLACEMENTS:
                raise StudyError(f"{key}.placement: {placement!r} is not one of {', '.join(PLACEMENTS)}")
            if placement == "none":
                points += [(m, None, "none", None, _number(s, f"{key}.seed", integer=True, minimum=0))
                           for m in axes["model"] for s in axes["seed"]]
                continue
            if not axes["estimator"] or not axes["beta"]:
                raise StudyError(f"{key}: a KL placement needs estimator and beta")
            for m, e, b, s in itertools.product(axes["model"], axes["estimator"], axes["beta"], axes["seed"]):
                if e not in ESTIMATORS:
                    raise StudyError(f"{key}.estimator: {e!r} is not one of {', '.join(ESTIMATORS)}")
                points.append((m, e, placement, float(_number(b, f"{key}.beta", minimum=0)),
                               _number(s, f"{key}.seed", integer=True, minimum=0)))
    return points


def _run_config(shared: dict[str, Any], model: ModelSpec, model_path: str, point: tuple) -> dict[str, Any]:
    name, estimator, placement, beta, seed = point
    coords: dict[str, Any] = {"model": {"path": model_path, "name": name}, "train": {"seed": seed},
                              "objective": {"placement": placement}}
    if placement != "none":
        coords["objective"].update(estimator=estimator, beta=float(beta))
    return _merge(_merge(shared, model.run), coords)


def _check_run_config(config: dict[str, Any], model: ModelSpec):
    """One run's validated trainer config; an error names the key where the study sets the bad value."""
    from trainer.config import ConfigError, from_dict

    try:
        return from_dict(config)
    except ConfigError as error:
        section, _, rest = str(error).partition(".")
        key = rest.split(":")[0].split("[")[0]
        where = f"models.{model.name}.run" if key in model.run.get(section, {}) else "run"
        raise StudyError(f"{where}.{error}") from None


def _data(raw: Any) -> dict[str, dict[str, Any]]:
    data = {}
    for name, spec in _mapping(raw, "data").items():
        key = f"data.{name}"
        if not isinstance(name, str) or not _NAME.match(name):
            raise StudyError(f"{key}: a data set name may hold letters, digits and . _ + -")
        spec = _mapping(spec, key)
        _known(spec, ("task", "options", "n", "start"), key)
        if spec.get("task", "arithmetic") not in TASK_NAMES:
            raise StudyError(f"{key}.task: {spec['task']!r} is not one of {', '.join(TASK_NAMES)}")
        _mapping(spec.get("options"), f"{key}.options")
        for number in ("n", "start"):
            if number in spec:
                _number(spec[number], f"{key}.{number}", integer=True, minimum=0 if number == "start" else 1)
        data[name] = {"task": "arithmetic", "options": {}, "n": 200, "start": 0, **spec}
    return data


def _evaluate(raw: Any, data: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from eval.suites import NEEDS_DATA, SUITES, TASKS, expand

    spec = _mapping(raw, "evaluate")
    _known(spec, EVAL_KEYS, "evaluate")
    merged = {"suites": ["in_domain", "out_of_domain"], "samples": 1, "limit": None, "every": 0, "batch_size": 8,
              "max_gen_toks": None, "temperature": 1.0, "top_p": 1.0, "backend": "hf", "data": {}, **spec}
    merged["suites"] = _list(merged["suites"], "evaluate.suites")
    for i, suite in enumerate(merged["suites"]):
        if suite not in SUITES and suite not in TASKS:
            raise StudyError(f"evaluate.suites[{i}]: {suite!r} is neither a suite ({', '.join(SUITES)}) nor a "
                             f"task ({', '.join(TASKS)})")
    _number(merged["samples"], "evaluate.samples", integer=True, minimum=1)
    _number(merged["every"], "evaluate.every", integer=True, minimum=0)
    _number(merged["batch_size"], "evaluate.batch_size", integer=True, minimum=1)
    for name in ("limit", "max_gen_toks"):
        if merged[name] is not None:
            _number(merged[name], f"evaluate.{name}", integer=True, minimum=1)
    for name in ("temperature", "top_p"):
        _number(merged[name], f"evaluate.{name}", minimum=0)
    if merged["backend"] not in ("hf", "vllm"):
        raise StudyError(f"evaluate.backend: {merged['backend']!r} is not one of hf, vllm")
    sources = _mapping(merged["data"], "evaluate.data")
    for task, source in sources.items():
        if task not in TASKS:
            raise StudyError(f"evaluate.data.{task}: no such task ({', '.join(TASKS)})")
        if not isinstance(source, str) or not source:
            raise StudyError(f"evaluate.data.{task}: expected a data set name from `data`, a file or a hub id")
        if source not in data and source.endswith((".jsonl", ".json", ".parquet")) and not Path(source).exists():
            log.warning("evaluate.data.%s: %s does not exist (yet); evaluating %s will fail until it does",
                        task, source, task)
    for task in expand(merged["suites"]):  # every name was checked above
        if task in NEEDS_DATA and task not in sources:
            raise StudyError(f"evaluate.data.{task}: required, since {task} has no public default data set")
    return merged


def load_study(data: dict[str, Any]) -> Study:
    """The validated study described by a parsed study config."""
    data = _mapping(data, "config")
    _known(data, TOP_KEYS, "")
    name = data.get("study")
    if not isinstance(name, str) or not _NAME.match(name):
        raise StudyError(f"study: expected a name (letters, digits, . _ + -), got {name!r}")
    results = data.get("results", "results")
    if not isinstance(results, str) or not results:
        raise StudyError(f"results: expected a directory, got {results!r}")
    models = _models(data)
    grid = _mapping(data.get("grid"), "grid")
    shared = _mapping(data.get("run"), "run")
    for key in ("path", "name"):
        if key in _mapping(shared.get("model"), "run.model"):
            raise StudyError(f"run.model.{key}: set by the study from `models` (a model's key is its name)")
    study_data = _data(data.get("data"))
    evaluate = _evaluate(data.get("evaluate"), study_data)
    tracking = _mapping(data.get("tracking"), "tracking")
    _known(tracking, ("uri",), "tracking")
    resources_raw = _mapping(data.get("resources"), "resources")
    _known(resources_raw, ("default", *RULES), "resources")
    default = {"cpus": 1, "mem_mb": 2000, "runtime": 60, "gpus": 0,
               **_resources(resources_raw.get("default"), "resources.default")}
    resources = {rule: {**default, **_resources(resources_raw.get(rule), f"resources.{rule}")} for rule in RULES}

    runs, validated = [], {}
    for point in _grid_points(grid, list(models)):
        model = models[point[0]]
        path = str(Path(results) / "models" / model.name) if model.build is not None else model.path
        config = _run_config(shared, model, path, point)
        every = evaluate["every"]
        if every:  # the checkpoints to evaluate must outlive checkpoint.keep, and get their objective measured
            config = _merge(config, {"checkpoint": {"keep_every": every}})
            if config.get("measure", {}).get("prompts") and not config["measure"].get("every"):
                config = _merge(config, {"measure": {"every": every}})
        # Runs that differ only in their grid coordinates (checked above) validate alike: check one each.
        shape = json.dumps({**config, "objective": {**config["objective"], "estimator": None, "beta": None},
                            "train": {**config["train"], "seed": None}}, sort_keys=True, default=str)
        if shape not in validated:
            validated[shape] = _check_run_config(config, model)
        checked = validated[shape]
        if every % checked.checkpoint.every:
            raise StudyError(f"evaluate.every: {every} is not a multiple of run.checkpoint.every "
                             f"({checked.checkpoint.every}), so those steps have no checkpoint to evaluate")
        runs.append(RunSpec(run_id(*point), *point, config=config))
    if not runs:
        raise StudyError("grid: selects no runs (check estimators, placements, betas, baseline and exclude)")
    ids = [r.run_id for r in runs]
    if len(set(ids)) != len(ids):  # two betas that print alike, such as 0.1 and 0.10000000001
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise StudyError(f"grid.betas: two grid points share the run id {duplicate}")
    return Study(name, Path(results), models, runs, study_data, evaluate, tracking.get("uri"), resources,
                 _bundle(data.get("bundle")))


def _bundle(raw: Any) -> dict[str, int]:
    """Grid points per job of each bundled rule (default 1: a job per grid point)."""
    spec = _mapping(raw, "bundle")
    _known(spec, BUNDLED, "bundle")
    return {rule: _number(spec.get(rule, 1), f"bundle.{rule}", integer=True, minimum=1) for rule in BUNDLED}
