"""A run's coordinates in its study: a mapping of axis names to values, read from its config.

The standard axes are model, estimator, placement, beta and seed. Any other run-config key, written
dotted (`train.async_level`, `objective.kl_loss_ratio`), can be an axis too. Grid expansion, run ids,
MLflow tags, tables and figures all read this mapping and never fixed positions.

What a run's config does not use is no coordinate: a run without KL has no estimator, beta or KL
loss ratio, and a run with the KL only in the reward has no KL loss ratio
(`ObjectiveConfig.inert_fields`). Such a coordinate is None ("-" in tables), and a study runs that
point once, not once per value.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from trainer.objective import estimators, placements, presets

STANDARD = ("model", "estimator", "placement", "beta", "seed")
STANDARD_KEYS = {"estimator": "objective.estimator", "placement": "objective.placement", "beta": "objective.beta",
                 "seed": "train.seed"}
NOT_AXES = {"model.path", "model.name", *STANDARD_KEYS.values()}  # the standard axes' own config keys
# Run-id parts of common axes: prefix + value (`async2`, `ratio-detached`); any other key gives
# `<its last part>-<value>` (`max_operand-9`).
ID_PREFIXES = {"objective.kl_loss_ratio": "ratio-", "train.async_level": "async", "objective.advantage": "adv-",
               "objective.loss_agg": "agg-", "objective.clip_eps": "clip", "objective.tis_cap": "tis",
               "train.lr": "lr", "train.group_size": "g", "train.epochs": "epochs", "train.minibatches": "mb"}
NO_VALUE = "-"  # a coordinate the run does not use, in tables
_UNSAFE = re.compile(r"[^A-Za-z0-9._+,=-]")


def value_text(value: Any) -> str:
    """A coordinate as tables, ids and tags show it: 1.0 -> 1, 3e-4 -> 0.0003, [0.9, 0.99] -> 0.9,0.99."""
    if value is None:
        return NO_VALUE
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, (list, tuple)):
        return ",".join(value_text(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def same_value(a: Any, b: Any) -> bool:
    """Equal as coordinates (1 and 1.0 are the same beta, async level or learning rate)."""
    return value_text(a) == value_text(b)


def id_part(key: str, value: Any) -> str:
    """An extra axis's part of a run id, safe as a directory name and a wildcard."""
    prefix = ID_PREFIXES.get(key, key.rsplit(".", 1)[-1] + "-")
    text = "none" if value is None else value_text(value)
    return _UNSAFE.sub("_", prefix + text)


def header(key: str, keys: list[str]) -> str:
    """An extra axis's column header: its last part, unless two axes share it."""
    short = key.rsplit(".", 1)[-1]
    return short if sum(k.rsplit(".", 1)[-1] == short for k in keys) == 1 else key


def heading(axis: str, extra: list[str]) -> str:
    """Any axis's name in tables and figures: model, beta, ...; an extra axis's `header`."""
    return axis if axis in STANDARD else header(axis, extra)


def extra_of(coords: dict[str, Any]) -> list[str]:
    """The extra axes of a coordinate mapping, in its order."""
    return [key for key in coords if key not in STANDARD]


def covers(coords: dict[str, Any], point: dict[str, Any]) -> bool:
    """Whether a run at `coords` belongs at `point`: equal wherever it uses the axis (a coordinate it
    does not use, None, belongs at every value)."""
    return all(coords[k] is None or same_value(coords[k], v) for k, v in point.items())


def lookup(config: dict[str, Any], key: str, default: Any = None) -> Any:
    """The value at a dotted key of a nested config."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


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


def inert_keys(config: dict[str, Any]) -> frozenset[str]:
    """The dotted keys of `config` that its run never reads (see trainer's ObjectiveConfig.inert_fields)."""
    from trainer.objective.objective_config import ObjectiveConfig

    section = config.get("objective") or {}
    try:
        section = presets.expand(section)  # a preset's values fill in the keys not given
        objective = ObjectiveConfig(**{k: v for k, v in section.items() if k in ObjectiveConfig.field_names()})
    except (TypeError, ValueError):  # not a config the trainer would run: nothing is known to be inert
        return frozenset()
    return frozenset(f"objective.{name}" for name in objective.inert_fields())


def model_name(config: dict[str, Any]) -> str:
    model = config.get("model", {})
    return model.get("name") or Path(str(model.get("path", ""))).name or "?"


def coords_of(config: dict[str, Any], extra: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A run's coordinates from its config: model, estimator, placement, beta, the `extra` axes
    (dotted keys) in their order, seed; None where the run does not use the key."""
    inert = inert_keys(config)
    coords: dict[str, Any] = {"model": model_name(config)}
    for axis in ("estimator", "placement", "beta"):
        key = STANDARD_KEYS[axis]
        coords[axis] = None if key in inert else lookup(config, key, "reward" if axis == "placement" else None)
    coords.update({key: None if key in inert else run_value(config, key) for key in extra})
    coords["seed"] = lookup(config, "train.seed", 0)
    return coords


@functools.cache
def _trainer_defaults() -> dict[str, Any]:
    from trainer.config import RunConfig

    return flatten(RunConfig().to_dict())


@functools.cache
def _config_keys() -> list[str]:
    return list(_trainer_defaults())


def run_value(config: dict[str, Any], key: str) -> Any:
    """A run's value at a dotted key; where its config lacks the key, the trainer's default. A run config
    lacks a key when an older trainer wrote it, before the key existed, and a new key's default keeps the old
    behaviour: so a run of a study that grows a new axis (objective.kl_to) sits at the default, not everywhere."""
    return lookup(config, key, _trainer_defaults().get(key))


def _with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A config's dotted keys, those it lacks at the trainer's defaults (as `run_value` reads them)."""
    flat = flatten(config)
    given = {".".join(key.split(".")[:depth]) for key in flat for depth in range(1, key.count(".") + 2)}
    return {**{k: v for k, v in _trainer_defaults().items() if k not in given}, **flat}


def config_order(key: str) -> tuple:
    """Where a dotted key sits in the run config (its sections and fields in declaration order; keys
    inside a mapping such as task.options by name): the order of extra axes everywhere, in run ids,
    table columns and figure names alike."""
    fields = _config_keys()
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth])
        if prefix in fields:
            return (fields.index(prefix), ".".join(parts[depth:]))
        inside = [i for i, name in enumerate(fields) if name.startswith(prefix + ".")]
        if inside:
            return (inside[0], ".".join(parts[depth:]))
    return (len(fields), key)


def extra_axes(configs: list[dict[str, Any]]) -> list[str]:
    """The run-config keys besides the standard axes whose values differ between runs of the same
    model (where the runs use them): the axes a set of runs was swept over, in config order
    (`config_order`)."""
    seen: dict[str, dict[str, set[str]]] = {}  # key -> model -> values
    for config in configs:
        inert, name = inert_keys(config), model_name(config)
        for key, value in _with_defaults(config).items():
            if key not in NOT_AXES and key not in inert:
                seen.setdefault(key, {}).setdefault(name, set()).add(json.dumps(value, sort_keys=True))
    # a key that some configs lack and the trainer no longer knows varies only if those that have it differ
    varying = [key for key, by_model in seen.items() if any(len(values) > 1 for values in by_model.values())]
    if PRESET in varying:  # a key that the preset sets is no axis of its own unless it varies within a preset
        varying = [key for key in varying if key not in PRESET_KEYS or _varies_within_preset(configs, key)]
    return sorted(varying, key=config_order)


PRESET = "objective.preset"
PRESET_KEYS = ({f"objective.{key}" for preset in presets.REGISTRY for key in preset.keys}
               | {f"rollout.{key}" for preset in presets.REGISTRY for key in preset.rollout})


def _varies_within_preset(configs: list[dict[str, Any]], key: str) -> bool:
    seen: dict[tuple[str, Any], set[str]] = {}
    for config in configs:
        where = (model_name(config), lookup(config, PRESET))
        seen.setdefault(where, set()).add(json.dumps(run_value(config, key), sort_keys=True))
    return any(len(values) > 1 for values in seen.values())


def configuration(coords: dict[str, Any]) -> str:
    """The row label of a KL configuration: estimator-placement, or `no KL`."""
    if coords["placement"] == "none":
        return "no KL"
    return f"{coords['estimator']}-{coords['placement']}"


def _order(value: Any) -> tuple:
    """Numbers by size, then text; an unused coordinate first."""
    if value is None:
        return (0, 0.0, "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (1, float(value), "")
    return (2, 0.0, value_text(value))


def sort_key(coords: dict[str, Any]) -> tuple:
    """Model, then beta (the no-KL baseline last), the extra axes, estimator and placement, seed."""
    extra = tuple(_order(coords[key]) for key in extra_of(coords))
    kl = coords["placement"] != "none"
    return (coords["model"], 0 if kl else 1, float(coords["beta"] or 0.0) if kl else 0.0, extra,
            estimators.REGISTRY.order(coords["estimator"]), placements.REGISTRY.order(coords["placement"]),
            _order(coords["seed"]))
