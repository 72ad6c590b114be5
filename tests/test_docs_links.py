"""The repository reads on its own: no file points to notes outside it, every relative link of the README and
of the docs pages resolves to a file (or folder) of the repository as a code host shows it, and the theory
page's table of verdicts is the one the estimators register. Model-free, fast."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify, unique

from trainer.objective import estimators

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# the team's private notes, which users never have (spelled in parts so that this file does not match)
OUTSIDE = ("../" + "shared", "KL_" + "THEORY", "DESIGN" + ".md")
FENCE = re.compile(r"^ *(```|~~~).*?^ *\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
HTML_LINK = re.compile(r"""(?:href|src)=["']([^"']+)["']""")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [REPO / name for name in listed.decode().split("\0") if name]


def test_no_file_refers_to_notes_outside_the_repository():
    offending = []
    for path in tracked_files():
        if not path.is_file() or path.is_symlink():
            continue
        text = path.read_bytes()
        offending += [f"{path.relative_to(REPO)}: {word}" for word in OUTSIDE if word.encode() in text]
    assert not offending, "files that point to notes users do not have:\n" + "\n".join(offending)


def _blanked(pattern: re.Pattern, text: str) -> str:
    return pattern.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # line numbers kept


def _prose(text: str) -> str:
    """The page without its fenced code blocks and code spans: their brackets are no links."""
    return _blanked(CODE_SPAN, _blanked(FENCE, text))


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link in a Markdown page: inline, reference definitions, HTML href and src."""
    text = _prose(page.read_text())
    found = [m for pattern in (INLINE_LINK, REFERENCE_LINK, HTML_LINK) for m in pattern.finditer(text)]
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in sorted(found, key=lambda m: m.start())]


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings, as the site's table of contents makes them (`toc`'s slugify)."""
    ids: set[str] = set()
    for match in HEADING.finditer(_blanked(FENCE, page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link's text
        ids.add(unique(slugify(title.replace("`", "").replace("*", ""), "-"), ids))
    return ids


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_in_the_repository(page):
    broken = []
    for line, target in links(page):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):  # http(s), mailto, ...
            continue
        path, _, anchor = target.partition("#")
        path = path.split("?")[0]
        resolved = (page.parent / path).resolve() if path else page
        if REPO not in (resolved, *resolved.parents) or not resolved.exists():
            broken.append(f"line {line}: {target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"line {line}: {target} (no heading with that anchor)")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_the_link_reader_finds_each_kind_of_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See [a](a.md#x), ![img](b.png) and [c `code`](../c.md \"title\").\n"
                    "`[not](a link)`\n```\n[nor](this.md)\n```\n[ref]: d/e.md\n<a href=\"f.md\">f</a>\n"
                    "## A `code` heading: reward+loss\n## A `code` heading: reward+loss\n")
    assert [t for _, t in links(page)] == ["a.md#x", "b.png", "../c.md", "d/e.md", "f.md"]
    assert anchors(page) == {"a-code-heading-rewardloss", "a-code-heading-rewardloss_1"}


# --- the theory page's table is the registered theory -----------------------------------------------------------


def _theory_table() -> tuple[list[str], dict[tuple[str, str], list[str]]]:
    """(estimators, {(placement, kl_loss_ratio): verdicts}) of docs/concepts/theory.md's table."""
    text = (REPO / "docs" / "concepts" / "theory.md").read_text()
    section = text.split("## What each configuration differentiates", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert header[:2] == ["placement", "KL-loss weight"], header
    table = {(row[0], "none" if row[1] == "-" else row[1]): row[2:] for row in body}
    assert len(table) == len(body), "a (placement, weight) row appears twice"
    return header[2:], table


def test_the_theory_pages_table_is_the_registered_theory():
    names, table = _theory_table()
    own = [e.name for e in estimators.REGISTRY
           if getattr(e.formula, "__module__", estimators.__name__) == estimators.__name__]  # not a plugin's
    assert set(own) <= set(names), f"estimators missing from the page's table: {set(own) - set(names)}"
    for column, name in enumerate(names):
        theory = estimators.REGISTRY[name].theory
        assert set(theory) <= set(table), f"{name}: rows missing from the page's table: {set(theory) - set(table)}"
        for key, verdicts in table.items():
            assert verdicts[column] == theory.get(key, "-"), (name, key, verdicts[column], theory.get(key))
