"""The reference pages, written into docs/ from the code they describe, and checked current by a test.

    python docs/gen_reference.py --write    rewrite every page of PAGES from its source
    python docs/gen_reference.py            say which pages differ from their source (exit 1), as the test does

The run config comes from trainer/config.py's dataclasses (type, default, the bound or the choices declared
beside a field, the comment or docstring line that says what a key does), the study config from
workflow/config/schema.yaml, the CLIs from their own argparse parsers, the shipped studies from their
configs and the benchmarks from their scripts. The pages are files like any other, so that they read the
same in the repository and on the site; tests/test_reference_pages.py fails when one is stale.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import logging
import os
import re
import typing
from pathlib import Path
from unittest import mock

import yaml

REPO = Path(__file__).resolve().parent.parent
GENERATED = ("*Generated from {source} by `python docs/gen_reference.py --write`; a test fails when this page is "
             "stale. Edit the source, not this page.*\n")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _yaml(value: typing.Any) -> str:
    plain = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(plain, default_flow_style=True, width=1000).removesuffix("\n...\n").strip()


def _type_name(annotation: typing.Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


# --- run config: trainer/config.py -------------------------------------------------------------------------


def _docstring_entries(cls: type, names: set[str]) -> dict[str, str]:
    """A field-list docstring (ObjectiveConfig's) as field -> text; an indented `word  text` line starts a
    sub-item on a line of its own."""
    entries, current = {}, None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        head = re.match(r"^(\w+)\s{2,}(.*)", line)
        if head and head.group(1) in names:
            current = head.group(1)
            entries[current] = head.group(2)
        elif current and line.strip():
            item = re.match(r"^\s+([\w.+-]+)\s{2,}(\S.*)", line)
            entries[current] += f"<br>`{item.group(1)}` {item.group(2)}" if item else f" {line.strip()}"
    return {name: _cell(text) for name, text in entries.items()}


def _declared(spec: dataclasses.Field) -> str:
    """The bound or the choices declared beside a field (trainer.config's `bounded` and `chosen`)."""
    if "choices" in spec.metadata:
        return "one of " + ", ".join(f"`{choice}`" for choice in spec.metadata["choices"])
    return f"`{spec.metadata['bound']}`" if "bound" in spec.metadata else ""


def _section_page(prefix: str, cls: type) -> list[str]:
    """One run-config section: its fields in source order with the comments on their lines; a comment
    line of its own (`# vllm only ...`) introduces the fields after it."""
    documented = _docstring_entries(cls, {f.name for f in dataclasses.fields(cls)})
    doc = inspect.getdoc(cls) or ""
    doc = "" if doc.startswith(f"{cls.__name__}(") else doc  # dataclass's own signature, not a docstring
    lines = [f"## `{prefix}`", ""]
    if doc and not documented:
        lines += [doc, ""]
    header = ["| key | type | default | what it does |", "|---|---|---|---|"]
    return lines + header + _field_rows(prefix, cls, header, documented) + [""]


def _field_rows(prefix: str, cls: type, header: list[str], documented: dict[str, str]) -> list[str]:
    """The table rows of a section's fields; a section within it (train.stop_if) as its own keys."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rows = []
    for source in inspect.getsource(cls).splitlines():
        note = re.match(r"^    #\s?(.*)", source)
        if note:
            rows += ["", _cell(note.group(1)), "", *header]
            continue
        field = re.match(r"^    (\w+): [^#]*?(?:\s+#\s?(.*))?$", source)
        if not field or field.group(1) not in fields:
            continue
        name = field.group(1)
        if dataclasses.is_dataclass(hints[name]):
            rows += _field_rows(f"{prefix}.{name}", hints[name], header, {})
            continue
        spec = fields[name]
        default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
        what = _cell(field.group(2) or "") or documented.get(name, "")
        what = "; ".join(part for part in (_declared(spec), what) if part)
        rows.append(f"| `{prefix}.{name}` | `{_cell(_type_name(hints[name]))}` | `{_yaml(default)}` | {what} |")
    return rows


def run_config_page() -> str:
    from trainer.config import RunConfig

    hints = typing.get_type_hints(RunConfig)
    lines = ["# Run config keys", "", GENERATED.format(
        source="`trainer/config.py` and `trainer/objective/objective_config.py`"),
             "A run config (`python -m trainer train --config FILE --out DIR`) has these sections. Every key can be",
             "overridden on the command line as `section.key=value` (read as YAML), and a study config's `run:`",
             "block holds the same sections. A bad value stops the run before any model loads, with an error",
             "that names its key.", ""]
    for field in dataclasses.fields(RunConfig):
        lines += _section_page(field.name, hints[field.name])
    return "\n".join(lines)


# --- study config: workflow/config/schema.yaml -------------------------------------------------------------


def _schema_rows(schema: dict, key: str, required: bool, rows: list[tuple[str, str, str]]) -> None:
    from sweep.study.config_schema import expected

    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        rows.append((key, f"see [{name}](#{name})", schema.get("description", "")))
        return
    notes = ["required"] if required else []
    notes += [f"default `{_yaml(schema['default'])}`"] if "default" in schema else []
    options = schema.get("oneOf", [])
    if options and all(set(option) == {"required"} for option in options):  # a choice of keys
        expects = "exactly one of " + " and ".join(f"`{name}`" for option in options for name in option["required"])
    else:
        expects = expected(schema)
    if key:
        description = schema.get("description", "")
        notes += [description] if description and description != expects else []
        rows.append((key, expects, "; ".join(notes)))
    for name, sub in schema.get("properties", {}).items():
        _schema_rows(sub, f"{key}.{name}" if key else name, name in schema.get("required", []), rows)
    for pattern, sub in schema.get("patternProperties", {}).items():
        rows.append((f"{key}.<dotted.key>" if key else "<dotted.key>", expected(sub) if "type" in sub else "any value",
                     f"a key matching `{pattern}`: {sub.get('description', '')}"))
    if isinstance(schema.get("additionalProperties"), dict):
        _schema_rows(schema["additionalProperties"], f"{key}.<name>", False, rows)
    if isinstance(schema.get("items"), dict) and ("$ref" in schema["items"] or "properties" in schema["items"]):
        _schema_rows(schema["items"], f"{key}[]", False, rows)


def _schema_table(schema: dict) -> list[str]:
    rows: list[tuple[str, str, str]] = []
    _schema_rows(schema, "", False, rows)
    return ["| key | expects | notes |", "|---|---|---|",
            *(f"| `{key}` | {_cell(expects)} | {_cell(notes)} |" for key, expects, notes in rows), ""]


def study_config_page() -> str:
    from sweep.study.config_schema import expected

    schema = yaml.safe_load((REPO / "workflow" / "config" / "schema.yaml").read_text())
    lines = ["# Study config keys", "", GENERATED.format(source="`workflow/config/schema.yaml`"),
             "A study config (the file that Snakemake's `--configfile` names) is checked whole before the DAG is",
             "built: first by `sweep.study.grid` (names, grid semantics, every run's config), then against this",
             "schema, one line per error naming the key. The `run` sections are the [run config](run-config.md).", "",
             "## The study", "", *_schema_table(schema)]
    for name, definition in schema.get("definitions", {}).items():
        body = _schema_table(definition) if "properties" in definition else [f"{expected(definition)}.", ""]
        lines += [f"## {name}", "", *body]
    return "\n".join(lines)


# --- command lines: the packages' argparse parsers ---------------------------------------------------------


class _Parser(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def cli_parser(package: str) -> argparse.ArgumentParser:
    """`python -m <package>`'s parser as its main() builds it, stopped before it parses."""
    def capture(self, args=None, namespace=None):
        raise _Parser(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            importlib.import_module(f"{package}.__main__").main([])
        except _Parser as built:
            return built.parser
    raise RuntimeError(f"{package}.__main__.main() built no argument parser")


def cli_page() -> str:
    lines = ["# Command lines", "", GENERATED.format(source="each package's argparse parser"),
             "Each command's `--help`, as `python -m trainer|eval|sweep ... --help` prints it.", ""]
    with mock.patch.dict(os.environ, {"COLUMNS": "100"}):
        for package in ("trainer", "eval", "sweep"):
            parser = cli_parser(package)
            lines += [f"## `{parser.prog}`", "", "```text", parser.format_help().rstrip(), "```", ""]
            for action in parser._actions:
                for name, sub in getattr(action, "choices", None).items() if isinstance(
                        action, argparse._SubParsersAction) else ():
                    lines += [f"### `{parser.prog} {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


# --- the shipped studies and the benchmarks ----------------------------------------------------------------


def _summary(path: Path) -> str:
    """The first sentence of a study config's leading comment: what it studies (the file says the rest)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return re.split(r"(?<=\.)\s+", " ".join(lines), maxsplit=1)[0]


def studies_page() -> str:
    from sweep.study.grid import load_study

    logging.getLogger("sweep.study.grid").setLevel(logging.ERROR)  # a study's data not yet exported is no news here
    lines = ["# The shipped studies", "", GENERATED.format(source="`workflow/config/*.yaml`"),
             "Each study config in `workflow/config/`, the first sentence of what it says it studies (the file",
             "says the rest), and the runs its grid expands to. Run one by naming its file, as in",
             "`.venv/bin/snakemake --profile profiles/local --configfile workflow/config/toy_quick.yaml`",
             "(`toy.yaml` is the default: `make study`); add `-n` to see the plan without running it.", ""]
    for path in sorted((REPO / "workflow" / "config").glob("*.yaml")):
        if path.name == "schema.yaml":
            continue
        data = yaml.safe_load(path.read_text())
        # an override file, which Snakemake merges over another study config: no models, or no study name
        if "models" not in data or "study" not in data:
            lines += [f"## `{path.relative_to(REPO)}`", "", "An override of another study config.", "",
                      _summary(path), ""]
            continue
        study = load_study(data)
        lines += [f"## `{path.relative_to(REPO)}`", "",
                  f"Study `{study.name}`: {len(study.runs)} runs of {', '.join(f'`{m}`' for m in study.models)};"
                  f" results under `{study.results}`.", "", _summary(path), ""]
    return "\n".join(lines)


class _Argument(typing.NamedTuple):
    """One `add_argument` call of a script, as its source says it (read, not run)."""

    names: list[str]
    metavar: str
    help: str
    flag: bool
    required: bool


def _arguments(tree: ast.AST) -> list[_Argument]:
    """A script's `add_argument` calls, in source order, less the internal ones (help=argparse.SUPPRESS)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        names = [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
        keywords = {k.arg: k.value for k in node.keywords}
        constant = {key: value.value for key, value in keywords.items() if isinstance(value, ast.Constant)}
        if isinstance(keywords.get("help"), ast.Attribute):  # argparse.SUPPRESS: a child process's option
            continue
        found.append(_Argument(names, constant.get("metavar", names[-1].lstrip("-").upper().replace("-", "_")),
                               constant.get("help", ""), constant.get("action") in ("store_true", "store_false"),
                               bool(constant.get("required"))))
    return found


def _usage(arguments: list[_Argument], command: str) -> str:
    """A script's usage line, as argparse would print it."""
    words = [command, "[-h]"]
    for argument in arguments:
        if not argument.names[0].startswith("-"):
            words.append(argument.metavar)
            continue
        word = argument.names[0] if argument.flag else f"{argument.names[0]} {argument.metavar}"
        words.append(word if argument.required else f"[{word}]")
    return " ".join(words)


def benchmarks_page() -> str:
    lines = ["# Benchmarks", "", GENERATED.format(source="`benchmarks/*.py`"),
             "Each benchmark measures klstudy side by side with a peer or an alternative, in one run, and",
             "reports ratios. Its docstring says what it measures; its options are below.", ""]
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        arguments = _arguments(tree)
        paragraphs = (ast.get_docstring(tree) or "").split("\n\n")
        lines += [f"## `{path.name}`", "", " ".join(paragraphs[0].split()), "",
                  f"`{_usage(arguments, f'python benchmarks/{path.name}')}`", ""]
        explained = [f"- `{' '.join(a.names)}`: {_cell(a.help)}" for a in arguments if a.help]
        lines += [*explained, ""] if explained else []
    return "\n".join(lines)


PAGES = {"reference/run-config.md": run_config_page, "reference/study-config.md": study_config_page,
         "reference/cli.md": cli_page, "results/studies.md": studies_page, "benchmarks/index.md": benchmarks_page}


def stale() -> list[str]:
    """The pages of PAGES (paths under docs/) whose file differs from what their source makes now."""
    return [path for path, build in PAGES.items()
            if not (REPO / "docs" / path).is_file() or (REPO / "docs" / path).read_text() != build() + "\n"]


def write() -> list[str]:
    """Every page of PAGES written from its source; the ones that changed."""
    changed = stale()
    for path in changed:
        (REPO / "docs" / path).write_text(PAGES[path]() + "\n")
    return changed


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(REPO))
    from docs.regenerate import main

    logging.basicConfig(level=logging.WARNING)
    sys.exit(main("docs/gen_reference.py", lambda: [f"docs/{path}" for path in stale()],
                  lambda: [f"docs/{path}" for path in write()]))
