"""Checking a study config's plain data: one StudyError whose message starts with the offending key."""

from __future__ import annotations

import copy
from typing import Any


class StudyError(ValueError):
    """A bad study config; the message starts with the offending key."""


def mapping(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise StudyError(f"{key}: expected a mapping, got {value!r}")
    return value


def listed(value: Any) -> list[Any]:
    """A list as given, a single value as a list of one, nothing as an empty list."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def known(data: dict[str, Any], allowed: tuple[str, ...], key: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        where = f"{key}.{unknown[0]}" if key else unknown[0]
        raise StudyError(f"{where}: unknown key (known: {', '.join(allowed)})")


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts merged, `extra` winning; neither input is changed."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def nested(key: str, value: Any) -> dict[str, Any]:
    """`a.b.c`, v -> {"a": {"b": {"c": v}}}."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def with_keys(base: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`base` with each dotted key of `values` set to its value; neither input is changed."""
    for key, value in values.items():
        base = merge(base, nested(key, value))
    return base


def number(value: Any, key: str, integer: bool = False, minimum: float | None = None) -> Any:
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
