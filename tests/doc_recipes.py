"""What the tests that run a page's commands as written share: reading the bash block a marker names, and a
copy of the repository made of links, in which those commands write their own results."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```bash\n(.*?)^```", re.M | re.S)


def recipe_block(page: Path, marker: str) -> list[str]:
    """The lines of the ```bash block on the line after `marker` in `page`."""
    text = page.read_text()
    at = text.index(marker) + len(marker) + 1
    block = BLOCK.match(text, at)
    assert block, f"{page.name}: {marker} is not followed by a ```bash block"
    return block.group(1).splitlines()


def linked_copy(work: Path, left_out: set[str]) -> Path:
    """`work` holding a link to each entry of the repository's root but those in `left_out` (what the commands
    write, or must not share with the suite), so that what the commands write stays in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name not in left_out:
            (work / entry.name).symlink_to(entry)
    return work
