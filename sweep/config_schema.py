"""The study config's JSON schema (workflow/config/schema.yaml), each error in one line that names the key.

sweep.grid checks a study first, in its own words; the schema then catches what sweep.grid leaves to
the jobs (the SFT warm-up's fields, top_p's bound, the types of tracking.uri and of the SLURM
resources). jsonschema's own error ends in a dump of the schema (225 lines for a typo at the top
level): here an error is the key, what is there and what the schema expects instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

_WORDS = {"integer": "a whole number", "number": "a number", "string": "a string", "boolean": "true or false",
          "object": "a mapping", "array": "a list", "null": "null"}
_PLURALS = {"integer": "whole numbers", "number": "numbers", "string": "strings", "object": "mappings"}


def schema_problem(config: dict[str, Any], schema_file: Path) -> str | None:
    """The first schema error of `config` as `<key>: <what is wrong> (<what is expected>)`, or None."""
    import jsonschema

    schema = yaml.safe_load(Path(schema_file).read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = min(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), str(e.absolute_path)),
                default=None)
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
        return f"{where}{missing}: required (expected {expected(schema['properties'].get(missing, {}))})"
    if error.validator == "oneOf" and all(set(option) == {"required"} for option in error.validator_value):
        names = [name for option in error.validator_value for name in option["required"]]
        return f"{key}: give exactly one of {', '.join(names[:-1])} and {names[-1]}"
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
