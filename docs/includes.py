"""Files shown whole in a page, as they are in the repository: a fenced block between
`<!-- include: PATH -->` and `<!-- /include -->` holds PATH's text (from the repository root), so that the
page reads the same on a code host as on the site, and tests/test_doc_includes.py fails when it differs.

    python docs/includes.py --write    rewrite every included block from its file
    python docs/includes.py            say which blocks differ from their file (exit 1), as the test does
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^<!-- include: (\S+) -->\n```(\w*)\n(.*?)^```\n<!-- /include -->$", re.M | re.S)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def included(page: Path) -> list[tuple[str, str]]:
    """(path, text in the page) of each included block of `page`."""
    return [(match.group(1), match.group(3)) for match in BLOCK.finditer(page.read_text())]


def stale() -> list[str]:
    """`page: path` for every block whose text is not its file's."""
    return [f"{page.relative_to(REPO)}: {path}" for page in pages() for path, text in included(page)
            if not (REPO / path).is_file() or text != (REPO / path).read_text()]


def write() -> list[str]:
    """Every included block rewritten from its file; the pages that changed."""
    changed = []
    for page in pages():
        old = page.read_text()
        new = BLOCK.sub(lambda m: f"<!-- include: {m.group(1)} -->\n```{m.group(2)}\n{(REPO / m.group(1)).read_text()}"
                                  f"```\n<!-- /include -->", old)
        if new != old:
            page.write_text(new)
            changed.append(str(page.relative_to(REPO)))
    return changed


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from docs.regenerate import main

    sys.exit(main("docs/includes.py", stale, write))
