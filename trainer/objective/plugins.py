"""Objectives that extend from outside: a package registers its own estimators, placements, advantages,
ratios or aggregations through the entry-point group `klstudy.objectives`.

    [project.entry-points."klstudy.objectives"]
    my_estimators = "my_package.klstudy_objectives"

An entry point names a module, whose import registers (`estimators.REGISTRY.register(...)`,
`@pg_ratios.register("name")`, ...), or a callable, called once with no argument. `load` loads every one,
once per process; the trainer's command line (training and the audit alike), the study's command line and
the Snakefile call it first, before any registry is read, so that a plugin's names are valid choices
everywhere. Free of torch.
"""

from __future__ import annotations

import importlib.metadata
import types

GROUP = "klstudy.objectives"
_loaded: list[str] = []


class PluginError(ValueError):
    """An entry point of `GROUP` that does not load; the message names it."""


def load() -> tuple[str, ...]:
    """Load every installed entry point of `GROUP` (the first call only); the names of those loaded."""
    if _loaded:
        return tuple(_loaded[1:])
    _loaded.append(GROUP)  # loaded, or being loaded: a plugin that calls load itself does not recurse
    for entry in sorted(importlib.metadata.entry_points(group=GROUP), key=lambda e: e.name):
        try:
            target = entry.load()
            if callable(target) and not isinstance(target, types.ModuleType):
                target()
        except Exception as error:
            raise PluginError(f"{GROUP} entry point {entry.name} ({entry.value}): {type(error).__name__}: "
                              f"{error}") from error
        _loaded.append(entry.name)
    return tuple(_loaded[1:])
