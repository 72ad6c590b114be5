"""Where a model comes from, a local directory or a hub id, told apart without torch or the network.

trainer.model.models loads models through it, and the study checks every model with it before any job
starts (sweep.preflight): a local directory is checked here; a hub id can only be checked against
the local Hugging Face cache, since whether the hub has it needs the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def offline() -> bool:
    """Whether HF_HUB_OFFLINE forbids the hub: then a hub model must already be in the cache."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def is_local(name_or_path: str) -> bool:
    """A path that exists, or one that cannot be a hub id (./x, /x, ~/x, a/b/c)."""
    return (Path(name_or_path).expanduser().exists() or not _HUB_ID.match(name_or_path)
            or name_or_path.startswith((".", "/", "~")))


def local_problem(name_or_path: str) -> str | None:
    """What is wrong with a model given as a local directory, None for a usable one or a hub id."""
    if not is_local(name_or_path):
        return None
    path = Path(name_or_path).expanduser()
    if not path.exists():
        return f"{name_or_path} does not exist"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json: is it a saved HF model?"
    return None


def in_hub_cache(hub_id: str) -> bool:
    """Whether the local Hugging Face cache holds the model's config (no network)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


def download_hint(hub_id: str) -> str:
    """The command that puts a hub model into the cache (the `hf` CLI of huggingface_hub)."""
    return f"hf download {hub_id}"
