"""One way to make the progress bars a person waits on."""

from __future__ import annotations

from tqdm import tqdm


def progress_bar(total: int, desc: str, show: bool | None = None) -> tqdm:
    """A tqdm bar on stderr. show=None lets tqdm decide: no bar unless stderr is a terminal."""
    return tqdm(total=total, desc=desc, disable=None if show is None else not show)
