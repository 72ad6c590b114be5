"""The grid's points: models x estimators x placements x betas x `grid.axes` x seeds, plus the no-KL
baseline, `include` and `exclude`; each point once, with its run id (extra axes in run-config order,
as tables and figures show them: sweep.study.axes.config_order).

An extra axis is any run-config key, dotted (`train.async_level`). A point keeps an extra value only
where its run uses the key and the value differs from the study's base (the `run` config, else the
trainer's default): the baseline crosses `train.async_level` but not `objective.kl_loss_ratio`, and
a run at the base value has the id it had before the axis existed.

`objective.preset` as an axis (each RL library's default KL configuration, trainer.objective.presets) sets each
run's estimator and placement: the grid then takes no estimators or placements of its own, crosses
the presets with its betas (one beta for every library: their objectives compare at it), and runs
the no-KL baseline once, without a preset.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from sweep.study import axes as coords
from sweep.study.checks import StudyError, known, listed, mapping, merge, number, with_keys
from trainer.objective import presets
from trainer.objective.estimators import REGISTRY as ESTIMATORS
from trainer.objective.placements import REGISTRY as PLACEMENTS
from trainer.objective.placements import kl_placements

GRID_KEYS = coords.STANDARD
PRESET = "objective.preset"  # an axis that sets each point's estimator and placement
GRID_SECTION = ("estimators", "placements", "betas", "seeds", "baseline", "axes", "include", "exclude")
RESERVED = {"model.path": "set from `models` (a model's key is its name)",
            "model.name": "set from `models` (a model's key is its name)",
            "objective.estimator": "an axis of its own: grid.estimators",
            "objective.placement": "an axis of its own: grid.placements (and grid.baseline)",
            "objective.beta": "an axis of its own: grid.betas", "train.seed": "an axis of its own: grid.seeds"}


def run_id(model: str, estimator: str | None, placement: str, beta: float | None, seed: int,
           extra: dict[str, Any] | None = None) -> str:
    """`<model>__<estimator>-<placement>__b<beta>[__<extra>...]__s<seed>`; `<model>__none[...]__s<seed>`."""
    kl = "none" if placement == "none" else f"{estimator}-{placement}__b{coords.value_text(beta)}"
    return "__".join([model, kl, *(coords.id_part(k, v) for k, v in (extra or {}).items()), f"s{seed}"])


@dataclass(frozen=True)
class Point:
    """A grid point; `extra` holds only the extra axes it uses at values other than the base's."""

    model: str
    estimator: str | None
    placement: str
    beta: float | None
    seed: int
    extra: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="grid", compare=False)  # the study key that made it: grid.baseline, grid.include[i]

    @property
    def run_id(self) -> str:
        return run_id(self.model, self.estimator, self.placement, self.beta, self.seed, self.extra)

    def signature(self) -> str:
        """Equal for points that are the same run."""
        return json.dumps([self.model, self.estimator, self.placement, self.beta, self.seed, self.extra],
                          sort_keys=True)

    def overrides(self) -> dict[str, Any]:
        """The point's coordinates as run-config values (besides the model's path and name)."""
        config: dict[str, Any] = {"train": {"seed": self.seed}, "objective": {"placement": self.placement}}
        if self.placement != "none":
            config["objective"].update(estimator=self.estimator, beta=float(self.beta))
        return with_keys(config, self.extra)


def check_axis_key(key: Any, where: str) -> str:
    """A dotted key of the run config that a study may sweep, or a StudyError saying why not."""
    from trainer.config import RunConfig

    if not isinstance(key, str) or "." not in key:
        raise StudyError(f"{where}: an axis is a dotted run-config key such as train.async_level, got {key!r}")
    if key in RESERVED:
        raise StudyError(f"{where}: {RESERVED[key]}")
    section, name, *deeper = key.split(".")
    sections = typing.get_type_hints(RunConfig)
    if section not in sections:
        raise StudyError(f"{where}: no run-config section {section!r} (known: {', '.join(sections)})")
    fields = {f.name: f for f in dataclasses.fields(sections[section])}
    if name not in fields:
        raise StudyError(f"{where}: {section} has no key {name!r} (known: {', '.join(fields)})")
    if deeper and typing.get_origin(typing.get_type_hints(sections[section])[name]) is not dict:
        raise StudyError(f"{where}: {section}.{name} is a value, not a mapping with keys")
    return key


def check_axis_values(key: str, values: Any, where: str, base: dict[str, Any],
                      others: dict[str, list[Any]] | None = None) -> list[Any]:
    """An axis's values as the trainer reads them (`1e-4` a float, `[0.9, 0.99]` Adam's pair). A value is
    refused when the trainer's config refuses it over the study's base config with every combination of
    the `others` axes' values (clip_eps_high needs some clip_eps); a value refused only in some
    combinations is left to those runs' own check."""
    from trainer.config import ConfigError, from_dict

    values = listed(values)
    if not values:
        raise StudyError(f"{where}: at least one value is required")
    contexts = [with_keys(base, combo) for combo in _combinations({k: listed(vs) for k, vs in (others or {}).items()})]
    checked = []
    for i, value in enumerate(values):
        errors = []
        for context in contexts:
            try:
                config = from_dict(with_keys(context, {key: value}))
            except ConfigError as error:
                errors.append(error)
                continue
            checked.append(coords.lookup(config.to_dict(), key, value))
            break
        else:
            first = errors[0]
            if first.key == key or first.key.startswith(f"{key}["):  # this value's fault; anything else is the run's
                raise StudyError(f"{where}[{i}]: {first.message}") from None
            checked.append(value)
    for i, value in enumerate(checked):
        if value in checked[:i]:
            raise StudyError(f"{where}[{i}]: {coords.value_text(value)} is listed twice")
    return checked


def _standard(grid: dict[str, Any]) -> tuple[list, list, list, list, bool]:
    estimators = listed(grid.get("estimators", list(ESTIMATORS.names)))
    placements = listed(grid.get("placements", list(kl_placements())))
    betas = [float(number(b, f"grid.betas[{i}]", minimum=0)) for i, b in enumerate(listed(grid.get("betas")))]
    seeds = [number(s, f"grid.seeds[{i}]", integer=True, minimum=0)
             for i, s in enumerate(listed(grid.get("seeds", [0])))]
    for i, name in enumerate(estimators):
        if name not in ESTIMATORS:
            raise StudyError(f"grid.estimators[{i}]: {name!r} is not one of {', '.join(ESTIMATORS.names)}")
    for i, name in enumerate(placements):
        if name not in kl_placements():
            raise StudyError(f"grid.placements[{i}]: {name!r} is not one of {', '.join(kl_placements())} "
                             "(the no-KL baseline comes from grid.baseline)")
    if placements and estimators and not betas:
        raise StudyError("grid.betas: at least one beta is required for the KL placements")
    if not seeds:
        raise StudyError("grid.seeds: at least one seed is required")
    baseline = grid.get("baseline", True)
    if not isinstance(baseline, bool):
        raise StudyError(f"grid.baseline: expected true or false, got {baseline!r}")
    return estimators, placements, betas, seeds, baseline


def _combinations(extra: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, as {key: value}."""
    return [dict(zip(extra, values, strict=True)) for values in itertools.product(*extra.values())]


class Expansion:
    """The points of one grid over the models' base configs (model name -> the full run config the
    study gives that model's runs before any grid coordinate)."""

    def __init__(self, grid: Any, base: dict[str, dict[str, Any]]) -> None:
        self.grid, self.base = mapping(grid, "grid"), base
        known(self.grid, GRID_SECTION, "grid")
        raw = mapping(self.grid.get("axes"), "grid.axes")
        for key in raw:
            check_axis_key(key, f"grid.axes.{key}")
        self.first = next(iter(base.values()))  # the base config axis values are checked against
        self.axes = {key: check_axis_values(key, values, f"grid.axes.{key}", self.first,
                                            {k: v for k, v in raw.items() if k != key})
                     for key, values in raw.items()}
        self.names = sorted(self.axes, key=coords.config_order)  # the extra axes, in id order

    def points(self) -> list[Point]:
        """Every point, each once, in grid order (models, estimators, placements, betas, extra axes,
        seeds; then the baselines, then include's)."""
        estimators, placements, betas, seeds, baseline = _standard(self.grid)
        models, combos = list(self.base), _combinations(self.axes)
        if PRESET in self.axes:
            raw = self._preset_points(models, betas, combos, seeds)
        else:
            raw = [(m, e, p, b, s, x) for m, e, p, b, x, s in
                   itertools.product(models, estimators, placements, betas, combos, seeds)]
        if baseline:
            plain = list({json.dumps(x, sort_keys=True): x for x in
                          ({k: v for k, v in x.items() if k != PRESET} for x in combos)}.values())
            raw += [(m, None, "none", None, s, x, "grid.baseline")
                    for m, x, s in itertools.product(models, plain, seeds)]
        raw += self._include(models)
        points = [self._point(*entry) for entry in raw]
        exclude = self._patterns()
        kept = [p for p in points if not any(self._matches(p, pattern) for pattern in exclude)]
        return list({p.signature(): p for p in kept}.values())

    def _preset_points(self, models: list[str], betas: list[float], combos: list[dict[str, Any]],
                       seeds: list[int]) -> list[tuple]:
        """Each preset's points: its own estimator and placement (a preset without a KL term is a no-KL
        run), at each of the grid's betas."""
        for key in ("estimators", "placements"):
            if key in self.grid:
                raise StudyError(f"grid.{key}: objective.preset is an axis and sets each run's estimator and "
                                 f"placement; leave grid.{key} out")
        raw = []
        for m, b, x, s in itertools.product(models, betas, combos, seeds):
            spec = presets.expand({"preset": x[PRESET]})
            raw.append((m, None, "none", None, s, x) if spec["placement"] == "none" else
                       (m, spec["estimator"], spec["placement"], b, s, x))
        return raw

    def value(self, point: Point, key: str) -> Any:
        """A point's value of an extra axis: its own, else the base's."""
        return point.extra.get(key, coords.lookup(self.base[point.model], key))

    def _point(self, model: str, estimator: str | None, placement: str, beta: float | None, seed: int,
               extra: dict[str, Any], origin: str = "grid") -> Point:
        """The point, without the extra values its run does not use or that equal the base's."""
        point = Point(model, estimator, placement, beta, seed, extra, origin)
        inert = coords.inert_keys(merge(self.base[model], point.overrides()))
        used = {key: extra[key] for key in self.names if key in extra and key not in inert
                and extra[key] != coords.lookup(self.base[model], key)}
        return dataclasses.replace(point, extra=used)

    def _entry_axes(self, entry: dict[str, Any], where: str, new_axes: bool) -> dict[str, list[Any]]:
        """The extra axes of an include or exclude entry, validated; with `new_axes`, keys that are not
        in grid.axes become axes too."""
        mine = {key: values for key, values in entry.items() if key not in GRID_KEYS}
        extra = {}
        for key in mine:
            check_axis_key(key, f"{where}.{key}")
        for key, values in mine.items():
            extra[key] = check_axis_values(key, values, f"{where}.{key}", self.first,
                                           {k: v for k, v in mine.items() if k != key})
            if new_axes and key not in self.names:
                self.names = sorted([*self.names, key], key=coords.config_order)
        return extra

    def _include(self, models: list[str]) -> list[tuple]:
        """Extra points; each entry may give lists, which expand as a small grid of their own."""
        raw = []
        for i, entry in enumerate(listed(self.grid.get("include"))):
            key = f"grid.include[{i}]"
            entry = mapping(entry, key)
            values = {name: listed(entry.get(name)) for name in GRID_KEYS}
            values["model"] = values["model"] or models
            values["seed"] = [number(s, f"{key}.seed", integer=True, minimum=0) for s in values["seed"] or [0]]
            combos = _combinations(self._entry_axes(entry, key, new_axes=True))
            for name in values["model"]:
                if name not in models:
                    raise StudyError(f"{key}.model: {name!r} is not one of the study's models ({', '.join(models)})")
            for placement in values["placement"] or [None]:
                if placement not in PLACEMENTS:
                    raise StudyError(f"{key}.placement: {placement!r} is not one of {', '.join(PLACEMENTS.names)}")
                if placement == "none":
                    raw += [(m, None, "none", None, s, x, key)
                            for m, x, s in itertools.product(values["model"], combos, values["seed"])]
                    continue
                if not values["estimator"] or not values["beta"]:
                    raise StudyError(f"{key}: a KL placement needs estimator and beta")
                for e in values["estimator"]:
                    if e not in ESTIMATORS:
                        raise StudyError(f"{key}.estimator: {e!r} is not one of {', '.join(ESTIMATORS.names)}")
                betas = [float(number(b, f"{key}.beta", minimum=0)) for b in values["beta"]]
                raw += [(m, e, placement, b, s, x, key) for m, e, b, x, s in
                        itertools.product(values["model"], values["estimator"], betas, combos, values["seed"])]
        return raw

    def _patterns(self) -> list[dict[str, list[Any]]]:
        patterns = []
        for i, entry in enumerate(listed(self.grid.get("exclude"))):
            where = f"grid.exclude[{i}]"
            entry = mapping(entry, where)
            pattern = {k: [float(x) if k == "beta" else x for x in listed(v)] for k, v in entry.items()
                       if k in GRID_KEYS}
            patterns.append({**pattern, **self._entry_axes(entry, where, new_axes=False)})
        return patterns

    def _matches(self, point: Point, pattern: dict[str, list[Any]]) -> bool:
        return all((getattr(point, key) if key in GRID_KEYS else self.value(point, key)) in allowed
                   for key, allowed in pattern.items())
