"""The study schema's first error (sweep.study.study_schema), in one line that names the key.

jsonschema's own error ends in a dump of the schema (225 lines for a typo at the top level): here an
error is the key, what is there and what the schema expects instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sweep.study.study_schema import schema as study_schema

_WORDS = {"integer": "a whole number", "number": "a number", "string": "a string", "boolean": "true or false",
          "object": "a mapping", "array": "a list", "null": "null"}
_PLURALS = {"integer": "whole numbers", "number": "numbers", "string": "strings", "object": "mappings"}


def schema_problem(config: dict[str, Any], schema_file: Path | None = None,
                   left_to: tuple[str, ...] = ()) -> str | None:
    """The first schema error of `config` as `<key>: <what is wrong> (<what is expected>)`, or None.
    `left_to`: the keys under which another check has its own, closer words (its errors are skipped)."""
    import jsonschema

    schema = study_schema(schema_file)
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = (e for e in validator.iter_errors(config) if not _key(e.absolute_path).startswith(left_to))
    error = min(errors, key=lambda e: (len(e.absolute_path), str(e.absolute_path)), default=None)
    return None if error is None else _message(error)


def _key(path) -> str:
    """['grid', 'include', 0, 'seed'] -> grid.include[0].seed."""
    key = ""
    for part in path:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key


def _message(error) -> str:
    key, schema, value = _key(error.absolute_path), error.schema, error.instance
    where = f"{key}." if key else ""
    if error.validator == "additionalProperties":
        unknown = sorted(name for name in value if name not in schema.get("properties", {}) and not any(
            re.search(pattern, name) for pattern in schema.get("patternProperties", {})))
        if unknown:
            known = list(schema.get("properties", {}))
            known += [spec.get("description", f"a key matching {pattern}")
                      for pattern, spec in schema.get("patternProperties", {}).items()]
            return f"{where}{unknown[0]}: unknown key (known: {', '.join(known)})"
    if error.validator == "required":
        missing = next(name for name in error.validator_value if name not in value)
        spec = schema["properties"].get(missing, {})
        return f"{where}{missing}: required ({spec.get('requiredHint') or f'expected {expected(spec)}'})"
    options = error.validator_value if error.validator == "oneOf" else None
    if options and all(set(option) <= {"required", "description"} for option in options):
        several = sum(name in value for option in options for name in option["required"]) > 1
        names = [f"{name} ({option['description']})" if several and "description" in option else name
                 for option in options for name in option["required"]]  # what each is, where several
        return f"{key}: give exactly one of {', '.join(names[:-1])} and {names[-1]}"
    if error.validator == "minimum" and not isinstance(value, bool):
        return f"{key}: must be >= {error.validator_value:g}, got {value}"
    return f"{key}: got {value!r} (expected {expected(schema)})"


def expected(schema: dict[str, Any]) -> str:
    """What a (sub)schema accepts, in words: `a whole number >= 1`, `one of hf, vllm`."""
    if "enum" in schema:
        return "one of " + ", ".join(map(str, schema["enum"]))
    if "oneOf" in schema:
        return ", or ".join(expected(option) for option in schema["oneOf"])
    types = schema.get("type", [])
    words = []
    for kind in types if isinstance(types, list) else [types]:
        word = _WORDS.get(kind, kind)
        if kind in ("integer", "number"):
            bounds = [f"{sign} {schema[name]:g}" for name, sign in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                                   ("maximum", "<=")) if name in schema]
            word = " ".join([word, " and ".join(bounds)]) if bounds else word
        elif kind == "string" and "pattern" in schema:
            word = schema.get("description") or f"{word} matching {schema['pattern']}"
        elif kind == "array":
            word += f" of {_PLURALS.get(schema.get('items', {}).get('type'), 'values')}"
            word += f", at least {schema['minItems']}" if "minItems" in schema else ""
        elif kind == "object" and "minProperties" in schema:
            word += f" with at least {schema['minProperties']} entry"
        words.append(word)
    return ", or ".join(words) or "something else"
