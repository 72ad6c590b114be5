"""Every command in the README and in the docs pages is checked, so that one that fails as written fails CI.

A command is a line of a ```bash block (continuations joined, `&&` split, here-documents skipped),
a usage line (an unlabelled block or an inline span: `[...]`, `a | b` and `...` are read as usage),
or an inline span that starts with a program. Each is checked the way its program allows without
running it:

- `python -m trainer|eval|sweep ...` and `python benchmarks/X.py ...`: the package's own argument
  parser reads the words as written, in this process, and is stopped before the command acts (a
  missing required option fails here as it would for the reader). Usage (`--n N`) and a mention
  without values (`python -m sweep track --follow`) must name a subcommand and options that its
  `--help` shows.
- `snakemake ...`: Snakemake's own command-line parser, with the profile; each --configfile must
  exist, and the study they make, merged in order as Snakemake merges them (an override file over a
  study), must pass the Snakefile's check (sweep.study.study_check).
- `mlflow ...`: MLflow's click command reads the options.
- `make TARGET`: `make -n` knows the target. `pip install -e ".[x]"`: pyproject declares extra x.
  `profiles/slurm/local-cluster.sh X`, `benchmarks/smol_gpu.sh X`: its usage line lists X.
- Shell built-ins and system tools (export, cat, chmod, ssh, rm, `.`) are passed by name; any other
  program fails the test until it gets a check here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]  # the generated reference pages are not files
PACKAGES = ("trainer", "eval", "sweep")
SHELL = {"export", "cat", "cp", "chmod", "ssh", "rm", ".", "source", "cd", "ls", "mkdir", "test",
         "nvidia-cuda-mps-control", "chromium"}


def _usage_tokens(words: list[str]) -> list[list[str]]:
    """A usage line's words as commands: `[--x V]` -> `--x V`, `a|b` -> a, `--p/--no-p` -> --p, `...` dropped;
    `cmd a | b` -> `cmd a` and `cmd b`."""
    alternatives = [[]]
    for word in words:
        if word == "|":
            alternatives.append([])
            continue
        word = word.strip("[]")
        if not word or word.endswith("..."):
            continue
        word = word.split("|")[0]
        if word.startswith("--") and "/--" in word:
            word = word.split("/")[0]
        alternatives[-1].append(word)
    first = alternatives[0]
    return [first] + [first[:-len(alt)] + alt for alt in alternatives[1:] if alt]


def _program_words(words: list[str]) -> list[str]:
    """Without leading VAR=value assignments, nor a trailing `&` (a server left running)."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return words[:-1] if words and words[-1] == "&" else words


def _commands(words: list[str], kind: str) -> list[list[str]]:
    """The commands that a page's command stands for: a usage line may stand for several."""
    return _usage_tokens(_program_words(words)) if kind == "usage" else [_program_words(words)]


def _is_command(words: list[str]) -> bool:
    words = _program_words(words)
    return bool(words) and (Path(words[0]).name in ("python", "snakemake", "make", "mlflow", "pip", "hf")
                            or words[0].startswith(("profiles/", "benchmarks/")))


def page_commands(page: Path) -> list[tuple[int, str, list[str], str]]:
    """(line, the text, its words, its kind: "run" (a ```bash line), "usage" or "inline") in a Markdown page."""
    text = page.read_text()
    found, fenced = [], set()
    for block in re.finditer(r"^( *)```(\w*)\n(.*?)^ *```", text, re.M | re.S):
        start = text[:block.start()].count("\n") + 1
        fenced.update(range(start, start + block.group(0).count("\n") + 1))
        lines = [line[len(block.group(1)):] for line in block.group(3).splitlines()]
        if block.group(2) == "bash":
            found += _bash_commands(lines, start + 1)
        elif block.group(2) == "" and lines and _is_command(lines[0].split()):
            # a usage block: `python -m trainer audit [...]`, then options under labels ("gradient audit: ...")
            usage = " ".join([lines[0], *(re.sub(r"^\s*[\w ]+:\s", " ", line) for line in lines[1:])])
            found.append((start + 1, usage, usage.split(), "usage"))
    for number, line in enumerate(text.splitlines(), 1):
        if number in fenced:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            try:
                words = shlex.split(span)
            except ValueError:  # an unbalanced quote: not a command
                continue
            if len(words) > 1 and _is_command(words):  # one word names a program or file (`make`, `hf`)
                usage = bool(re.search(r"(^|\s)\[|\s\|\s|\.\.\.", span))
                found.append((number, span, words, "usage" if usage else "inline"))
    return found


def _bash_commands(lines: list[str], first: int) -> list[tuple[int, str, list[str], str]]:
    found, heredoc, pending, at = [], None, "", first
    for number, line in enumerate(lines, first):
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if not pending:
            at = number
        pending += line.rstrip("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        words = shlex.split(pending, comments=True)
        pending = ""
        marker = re.search(r"<<-?'?(\w+)'?", line)
        if marker:
            heredoc = marker.group(1)
            words = words[:next(i for i, w in enumerate(words) if w.startswith("<<"))]
        command: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                if command:
                    found.append((at, " ".join(command), command, "usage" if "..." in command else "run"))
                command = []
            else:
                command.append(word)
    return found


# --- one check per program -----------------------------------------------------------------------------


class _Parsed(Exception):
    """Raised by the patched parse_args: the words parsed, nothing ran."""


def _parse_with_argparse(run, argv_label: str) -> None:
    """Call `run` with argparse stopped right after the top-level parse; fail with argparse's own error."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    err, out = io.StringIO(), io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            run()
        except _Parsed:
            return
        except SystemExit as exit:
            if exit.code in (0, None):
                return
            pytest.fail(f"{argv_label}: {err.getvalue().strip().splitlines()[-1]}")
    pytest.fail(f"{argv_label}: ran without parsing its arguments")


def _help_text(package: str, subcommand: list[str], label: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit:
        importlib.import_module(f"{package}.__main__").main([*subcommand, "--help"])
    assert exit.value.code == 0, f"{label}: {err.getvalue().strip().splitlines()[-1]}"
    return out.getvalue()


def check_python(words: list[str], kind: str, label: str) -> None:
    args = words[1:]
    if args[0] == "-m":
        module, args = args[1], args[2:]
        if module not in PACKAGES:
            assert importlib.util.find_spec(module) is not None, f"{label}: no module {module}"
            return
        values, options = [a for a in args if not a.startswith("-")], [a for a in args if a.startswith("-")]
        if kind == "usage" or (len(values) <= 1 and (not options or kind == "inline")):
            # usage (`--n N`), or a mention (`eval run`, `sweep track --follow`): what it names, its --help shows
            shown = _help_text(module, values[:1], label)
            for option in options:
                assert re.search(rf"(^|\s|\[){re.escape(option)}\b", shown), f"{label}: {option} is not in its --help"
            return
        main = importlib.import_module(f"{module}.__main__").main
        _parse_with_argparse(lambda: main(args), label)
        return
    script = REPO / args[0]
    assert script.is_file(), f"{label}: no {args[0]}"
    assert "argparse" in script.read_text(), f"{label}: {args[0]} takes no arguments to check without running it"
    with mock.patch.object(sys, "argv", [str(script), *args[1:]]):
        _parse_with_argparse(lambda: runpy.run_path(str(script), run_name="__main__"), label)


def _placeholder(value: str) -> bool:
    return bool(re.fullmatch(r"[A-Z]|<[^>]+>", value))


def written_by(page: str) -> dict[str, str]:
    """The files a page's commands write from a here-document (`cat > NAME <<'EOF'`): name -> text."""
    text = (REPO / page).read_text()
    return {m.group(1): m.group(3) for m in re.finditer(r"^cat > (\S+) <<'?(\w+)'?\n(.*?)^\2$", text, re.M | re.S)}


def check_snakemake(words: list[str], label: str, monkeypatch, written: dict[str, str] | None = None) -> None:
    import yaml
    from snakemake.cli import parse_args
    from snakemake.utils import update_config

    from sweep.study.study_check import check_study

    monkeypatch.chdir(REPO)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            _, args = parse_args(words[1:])
        except SystemExit:
            pytest.fail(f"{label}: {err.getvalue().strip().splitlines()[-1]}")
    written = written or {}
    configs = [Path(config) for config in args.configfile or [] if not _placeholder(str(config))]
    for config in configs:
        assert config.is_file() or str(config) in written, f"{label}: no {config}"
    if configs:
        study: dict = {}
        for config in configs:  # later files override earlier ones, as Snakemake's --configfile does
            text = config.read_text() if config.is_file() else written[str(config)]  # a file the page writes
            update_config(study, yaml.safe_load(text))
        check_study(study, REPO / "workflow" / "config" / "schema.yaml")


# Every mlflow command of the pages, parsed in one child process (JSON lists of words in, one error or "" per
# command out): importing MLflow costs a child 4-7 s of CPU, once rather than once per command. In a child:
# resolving `mlflow ui` imports Flask, whose request proxies, once in this process's sys.modules, break
# vLLM's start-up scan of every module (later tests build engines).
_MLFLOW_PARSE = """
import contextlib, json, sys, click
from mlflow.cli import cli

def error(args):
    command = cli.get_command(click.Context(cli), args[0])
    if command is None:
        return f"mlflow has no command {args[0]}"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            command.make_context(args[0], args[1:])
    except click.exceptions.Exit as exit:
        return "" if exit.exit_code == 0 else f"exits with {exit.exit_code}"
    except click.ClickException as error:
        return error.format_message()
    return ""

print(json.dumps([error(args) for args in json.load(sys.stdin)]))
"""


@functools.cache
def _mlflow_errors() -> dict[tuple[str, ...], str]:
    """Each mlflow command of the pages (its words after `mlflow`) and what MLflow's parser said of it."""
    commands = sorted({tuple(command[1:]) for _, _, _, words, kind in COMMANDS for command in _commands(words, kind)
                       if Path(command[0]).name == "mlflow"})
    done = subprocess.run([sys.executable, "-c", _MLFLOW_PARSE], input=json.dumps(commands), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(commands, json.loads(done.stdout), strict=True))


def check_mlflow(words: list[str], label: str) -> None:
    error = _mlflow_errors()[tuple(words[1:])]
    assert not error, f"{label}: {error}"


def check_make(words: list[str], label: str) -> None:
    done = subprocess.run(["make", "-n", "-C", str(REPO), *words[1:]], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{label}: {done.stderr.strip()}"


def check_pip(words: list[str], label: str) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for word in words:
        wanted = re.fullmatch(r"\.\[([\w,-]+)\]", word)
        for extra in wanted.group(1).split(",") if wanted else []:
            assert extra in extras, f"{label}: pyproject.toml declares no extra {extra}"


def check_script(words: list[str], label: str) -> None:
    script = REPO / words[0]
    assert script.is_file() and script.stat().st_mode & 0o111, f"{label}: {words[0]} is not an executable file"
    usage = re.search(r"usage: \$0 ([\w|]+)", script.read_text())
    assert usage and words[1] in usage.group(1).split("|"), f"{label}: {words[0]} has no subcommand {words[1]}"


COMMANDS = [(str(page.relative_to(REPO)), *command) for page in PAGES for command in page_commands(page)]


def test_the_pages_have_commands_of_every_kind():
    """The extraction itself: the fenced, usage and inline commands are all found (a change in the
    pages' markup must not make this test check nothing)."""
    texts = [text for _, _, text, _, _ in COMMANDS]
    assert len(COMMANDS) > 100 and {page for page, *_ in COMMANDS} >= {"README.md", "docs/index.md"}
    assert ".venv/bin/snakemake --profile profiles/local" in texts  # a fenced bash line
    assert any(text.startswith("python -m trainer audit [--out DIR]") for text in texts)  # a usage block
    assert any(text.startswith("python -m trainer train --out results/runs/demo model.path=") for text in texts)  # \\
    assert any("mlflow server --app-name basic-auth" in text for text in texts)  # after a here-document
    assert ("pip install -e \".[test,gguf]\"", "inline") in [(text, kind) for _, _, text, _, kind in COMMANDS]


@pytest.mark.parametrize("page, line, text, words, kind", COMMANDS, ids=[f"{c[0]}:{c[1]}" for c in COMMANDS])
def test_every_command_parses_as_written(page, line, text, words, kind, monkeypatch):
    label = f"{page} line {line}: `{text}`"
    for command in _commands(words, kind):
        program = Path(command[0]).name
        if command[0] in SHELL:
            continue
        if program == "python":
            check_python(command, kind, label)
        elif program == "snakemake":
            check_snakemake(command, label, monkeypatch, written_by(page))
        elif program == "mlflow":
            check_mlflow(command, label)
        elif program == "make":
            check_make(command, label)
        elif program == "pip":
            check_pip(command, label)
        elif command[0].startswith("profiles/") or command[0].endswith(".sh"):
            check_script(command, label)
        else:
            pytest.fail(f"{label}: no check for the program {command[0]} (add one to tests/test_readme.py)")


def _sections(page: Path) -> set[str]:
    """What a reference may name: a heading, a heading's part before its colon, a bold paragraph title."""
    text = page.read_text()
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return ({h.strip("` ") for h in headings} | {h.split(":")[0] for h in headings}
            | set(re.findall(r"^\*\*([^*]+?)\.?\*\*", text, re.M)))


_CITATION = re.compile(r'(README|docs/[\w/.-]+\.md|\]\(([\w/.-]+\.md)(?:#[\w-]*)?\)), "([^"]+)"')


def test_every_reference_to_a_section_names_one():
    """`README, "X"`, `docs/page.md, "X"` and `[page](page.md), "X"` in the repository's files, and
    `see "X"` in the README itself, name a section of that page. profiles/local cited "Forcing a
    rerun", a section the README did not have."""
    cited = [(README.name, README, name) for pair in re.findall(r'(?:see|in) "([^"]+)"|"([^"]+)" (?:below|above)',
                                                                 README.read_text()) for name in pair if name]
    # the repository's files: tracked or not ignored (not an install's egg-info, results/ or site/)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for path in (REPO / name for name in listed):
        if path.suffix in (".py", ".yaml", ".smk", ".md", ".toml", ".sh", "") and path != Path(__file__) \
                and path.is_file():
            for target, link, name in _CITATION.findall(path.read_text(errors="replace")):
                page = (path.parent / link).resolve() if link else REPO / target
                cited.append((str(path.relative_to(REPO)), page, name))
    assert len(cited) > 15
    assert {page for _, page, _ in cited} >= {REPO / "docs" / "guides" / "study.md", REPO / "docs" / "peers.md"}
    sections = {page: _sections(page) for page in {page for _, page, _ in cited} if page.is_file()}
    assert [(where, str(page.relative_to(REPO)), name) for where, page, name in cited
            if " ".join(name.split()) not in sections.get(page, ())] == []
