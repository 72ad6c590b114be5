"""What has run where: docs/what_has_run.yaml, the one source, rendered as the table that README.md,
docs/index.md and docs/guides/gpus_vllm.md show between their markers, its links made relative to each
page so that they work on a code host and in the built site.

    python docs/what_has_run.py --write    rewrite the pages' tables from the YAML
    python docs/what_has_run.py            say which pages differ from it (exit 1), as the test does
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "docs" / "what_has_run.yaml"
PAGES = ("README.md", "docs/index.md", "docs/guides/gpus_vllm.md")
BEGIN = "<!-- what-has-run: generated from docs/what_has_run.yaml (python docs/what_has_run.py --write) -->"
END = "<!-- /what-has-run -->"
_LINK = re.compile(r"\]\(([^)#\s]+)")


def table(page: str) -> str:
    """The table as `page` (a path from the repository root) shows it."""
    data = yaml.safe_load(SOURCE.read_text())
    columns = data["columns"]
    here = os.path.dirname(page)
    lines = ["| | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in data["rows"]:
        cells = [row["capability"], *(row[key] for key in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return _LINK.sub(lambda m: "](" + os.path.relpath(m.group(1), here or "."), "\n".join(lines))


def section(text: str) -> tuple[int, int]:
    """Where a page's table stands: the span between its markers."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"needs the markers once each: {BEGIN} ... {END}")
    return text.index(BEGIN) + len(BEGIN), text.index(END)


def rendered(page: str) -> str:
    text = (REPO / page).read_text()
    start, end = section(text)
    return text[:start] + "\n" + table(page) + "\n" + text[end:]


def stale() -> list[str]:
    """The pages whose table is not the YAML's."""
    return [page for page in PAGES if rendered(page) != (REPO / page).read_text()]


def write() -> list[str]:
    """Every page's table rewritten from the YAML; the pages that changed."""
    changed = stale()
    for page in changed:
        (REPO / page).write_text(rendered(page))
    return changed


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from docs.regenerate import main

    sys.exit(main("docs/what_has_run.py", stale, write))
