"""The command line that the page writers share (gen_reference.py, includes.py, what_has_run.py): each
writes parts of the pages from a source in the repository, and each is run the same way.

    python docs/<writer>.py --write    rewrite what differs from its source, and say what changed
    python docs/<writer>.py            say what differs (exit 1), as its test does
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def main(script: str, stale: Callable[[], list[str]], write: Callable[[], list[str]],
         argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python {script}", description="say which generated parts of the "
                                     "pages differ from their source (exit 1), or rewrite them")
    parser.add_argument("--write", action="store_true", help="rewrite what differs, and say what changed")
    if parser.parse_args(argv).write:
        print("\n".join(f"wrote {entry}" for entry in write()) or "every page was current")
        return 0
    left = stale()
    print("\n".join(f"stale: {entry} (python {script} --write)" for entry in left) or "current")
    return 1 if left else 0
