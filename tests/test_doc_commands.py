"""The documentation's runnable commands, run as written.

A ```bash block on the line after `<!-- runnable -->` in a page under docs/ is runnable: its commands
(split as tests/test_readme.py splits the README's) run one after another, from the repository root as
a reader would, in a copy of the root made of links, so that what they write (results/, .snakemake/)
lands in a temporary directory. Each block runs on its own, from a clean copy. Blocks marked
`<!-- runnable: NAME -->` are one session: a page's blocks of one NAME run in order in the same copy,
each after the one before (a study run, then resumed, grown, repaired). Mark only blocks that run here
in seconds to a minute: the others are for the reader. A run that installs into `.venv` (`.venv/bin/pip
install ...`) gets an environment of its own in its copy, layered over the suite's, so that what it
installs stays there.
"""

from __future__ import annotations

import os
import re
import shlex
import site
import subprocess
import sys
from pathlib import Path

import pytest
from doc_recipes import BLOCK, linked_copy
from test_readme import _bash_commands, _program_words

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
MARKER = re.compile(r"^<!-- runnable(?:: ([\w-]+))? -->\n", re.M)
LEFT_OUT = {".git", "results", ".snakemake", "site"}  # what a command writes, or need not see


def runnable_blocks(docs: Path = DOCS) -> list[tuple[str, int, list[tuple[int, str, list[str], str]], str | None]]:
    """(page, line of the block's first command, its commands, its session or None) for every runnable
    block under `docs`."""
    found = []
    for page in sorted(docs.rglob("*.md")):
        text = page.read_text()
        for marker in MARKER.finditer(text):
            block = BLOCK.match(text, marker.end())
            name, line = str(page.relative_to(docs.parent)), text[:marker.start()].count("\n") + 1
            assert block, f"{name} line {line}: {marker.group(0).strip()} is not followed by a ```bash block"
            found.append((name, line + 2, _bash_commands(block.group(1).splitlines(), line + 2), marker.group(1)))
    return found


def runs(blocks) -> list[tuple[str, int, list[tuple[int, str, list[str], str]]]]:
    """What each test runs: a block alone, or a session's blocks one after another (at its first line)."""
    grouped: dict[tuple, tuple[str, int, list]] = {}
    for page, line, commands, session in blocks:
        key = (page, session) if session else (page, line)
        grouped.setdefault(key, (page, line, []))[2].extend(commands)
    return list(grouped.values())


BLOCKS = runnable_blocks()
RUNS = runs(BLOCKS)


def test_runnable_blocks_are_found(tmp_path):
    """The extraction itself: a marked block's commands, with continuations joined and comments dropped,
    sessions run in order, and a marker before anything but a bash block is an error rather than a
    block silently not run."""
    assert any(page == "docs/index.md" for page, _, _, _ in BLOCKS)
    assert any(session for _, _, _, session in BLOCKS)
    (tmp_path / "page.md").write_text("text\n<!-- runnable -->\n```bash\nmake a \\\n  b   # comment\nls && cat x\n"
                                      "```\n```bash\nnot marked\n```\n")
    [(_, line, commands, session)] = runnable_blocks(tmp_path)
    assert line == 4 and session is None
    assert [(at, words) for at, _, words, _ in commands] == [(4, ["make", "a", "b"]), (6, ["ls"]), (6, ["cat", "x"])]
    (tmp_path / "page.md").write_text("<!-- runnable: s -->\n```bash\nmake one\n```\ntext\n<!-- runnable -->\n```bash\n"
                                      "make alone\n```\n<!-- runnable: s -->\n```bash\nmake two\n```\n")
    assert [(line, [words for _, _, words, _ in commands]) for _, line, commands in runs(runnable_blocks(tmp_path))] \
        == [(3, [["make", "one"], ["make", "two"]]), (8, [["make", "alone"]])]
    (tmp_path / "page.md").write_text("<!-- runnable -->\n\n```bash\nls\n```\n")
    with pytest.raises(AssertionError, match="not followed by a ```bash block"):
        runnable_blocks(tmp_path)


def installs(commands) -> bool:
    return any(_program_words(words)[:2] == [".venv/bin/pip", "install"] for _, _, words, _ in commands)


def layered_venv(path: Path) -> None:
    """A virtual environment at `path` of its own (its pip, its site directory first) that also sees every
    package of the suite's environment: a .pth adds the suite's site directories, their own .pth files
    included (the editable install of klstudy among them)."""
    done = subprocess.run([sys.executable, "-m", "venv", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [own] = (path / "lib").glob("python*/site-packages")
    (own / "suite-packages.pth").write_text("".join(f"import site; site.addsitedir({directory!r})\n"
                                                    for directory in site.getsitepackages()))


def test_a_layered_venv_sees_the_suite_and_keeps_what_it_installs(tmp_path):
    layered_venv(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    seen = subprocess.run([str(python), "-c", "import torch, snakemake, trainer; print(trainer.__file__)"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert seen.returncode == 0, seen.stderr
    assert installs([(1, "", [".venv/bin/pip", "install", "-e", "x"], "")])
    assert not installs([(1, "", [".venv/bin/python", "-m", "pytest"], "")])


@pytest.mark.parametrize("page, line, commands", RUNS, ids=[f"{page}:{line}" for page, line, _ in RUNS])
def test_runnable_doc_commands_run(page, line, commands, tmp_path):
    own_venv = installs(commands)
    linked_copy(tmp_path, LEFT_OUT | ({".venv"} if own_venv else set()))
    if own_venv:
        layered_venv(tmp_path / ".venv")
    for at, _, words, _ in commands:
        program = _program_words(words)
        # the suite's PYTHONPATH, whose warm start (tests/conftest.py) serves these jobs too; the packages come
        # from the directory, as a reader's do
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   **dict(word.split("=", 1) for word in words[:len(words) - len(program)]))
        done = subprocess.run(program, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        assert done.returncode == 0, f"{page} line {at}: `{shlex.join(words)}` exited {done.returncode}:\n{tail}"
