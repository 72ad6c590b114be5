"""The study config's one schema: workflow/config/schema.yaml gives the shape, the types and the
defaults; the names a key may take are filled in here from the code that defines them (the trainer's
registries and choices, the evaluation's suites), so that no list of names is typed twice.

sweep.study.grid validates a study with it once (sweep.study.config_schema words each error), then checks what
a schema cannot say (the grid's points, every run's trainer config), and reads its defaults from it.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "workflow" / "config" / "schema.yaml"


def _choices() -> dict[str, tuple[str, ...]]:
    """What `choices: NAME` in the schema stands for."""
    from eval.harness import BACKENDS
    from eval.suites import SUITES, TASKS
    from trainer.choices import TASK_NAMES
    from trainer.objective import estimators, placements

    return {"TASK_NAMES": TASK_NAMES, "ESTIMATORS": estimators.REGISTRY.names,
            "KL_PLACEMENTS": placements.kl_placements(), "SUITES_AND_TASKS": (*SUITES, *TASKS),
            "BACKENDS": BACKENDS}


def _evaluate_hint() -> str:
    """Why `evaluate.suites` has no default, and what to give."""
    from eval.suites import SUITES, TASKS

    return (f"the suites or tasks to evaluate every final model on: suites {', '.join(SUITES)}; tasks "
            f"{', '.join(TASKS)}; for example evaluate: {{suites: [toy], data: {{arith: <a data entry>}}}}")


def _filled(node: Any, choices: dict[str, tuple[str, ...]]) -> Any:
    if isinstance(node, list):
        return [_filled(item, choices) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _filled(value, choices) for key, value in node.items()}
    if "choices" in node:
        node["enum"] = list(choices[node.pop("choices")])
    if node.get("requiredHint") == "EVALUATE":
        node["requiredHint"] = _evaluate_hint()
    return node


@lru_cache(maxsize=4)
def _load(path: Path, choices: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, Any]:
    return _filled(yaml.safe_load(Path(path).read_text()), dict(choices))


def _current(path: Path) -> dict[str, Any]:
    """The schema filled with the names registered now (so that a plugin's count whenever it registers)."""
    return _load(Path(path), tuple(_choices().items()))


def schema(path: Path | None = None) -> dict[str, Any]:
    """The schema, its `choices: NAME` replaced by `enum: [the names]` (a copy: callers may change it)."""
    return copy.deepcopy(_current(Path(path or SCHEMA_FILE)))


def defaults(*keys: str) -> dict[str, Any]:
    """The defaults of a mapping's keys, at the dotted path `keys` (`evaluate`; `data`'s entries: "data", "*")."""
    node = _current(SCHEMA_FILE)
    for key in keys:
        node = node["additionalProperties"] if key == "*" else node["properties"][key]
    return {name: copy.deepcopy(spec["default"]) for name, spec in node["properties"].items() if "default" in spec}


def default(*keys: str) -> Any:
    """One key's default, at the dotted path `keys` (`results`; `resources`, `default`)."""
    *parent, name = keys
    return defaults(*parent)[name] if parent else copy.deepcopy(_current(SCHEMA_FILE)["properties"][name]["default"])
