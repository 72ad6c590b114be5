"""Atomic checkpoints, validated loading, and resume.

A checkpoint is written into a temporary directory and renamed into place, so checkpoints/step_N
is complete or absent. Its manifest, written last, records every file's size; a checkpoint whose
files do not match it (a partial copy, a truncated file) or that fails to load is skipped with a
warning and the next newest is tried.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


def save(checkpoints_dir: Path, step: int, model, trainer_state: dict[str, Any], keep: int, keep_every: int = 0,
         tokenizer=None, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoints/step_<step> atomically, then delete all but the newest `keep` (a step that is a
    multiple of `keep_every` is never deleted). With the tokenizer, step_<step>/model is a complete HF
    model directory that evaluation can load. `state_dict` (the whole weights, when `model` is sharded)
    is saved instead of the model's own."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / f"step_{step}"
    tmp = checkpoints_dir / f".step_{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model", state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "model")
    torch.save(trainer_state, tmp / "trainer_state.pt")
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(_steps(checkpoints_dir), reverse=True)[keep:]:
        if keep_every and old % keep_every == 0:
            continue
        shutil.rmtree(checkpoints_dir / f"step_{old}", ignore_errors=True)
    return final


def _steps(checkpoints_dir: Path) -> list[int]:
    if not checkpoints_dir.is_dir():
        return []
    return [int(m.group(1)) for p in checkpoints_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]


def verify(path: Path) -> str | None:
    """None if the checkpoint at `path` matches its manifest, else what is wrong with it."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest (an interrupted write)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "unreadable manifest"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    return None


def load_latest(checkpoints_dir: Path, model) -> tuple[int, dict[str, Any]] | None:
    """Load the newest valid checkpoint's weights into `model`; (step, trainer state) or None."""
    from safetensors.torch import load_file

    for step in sorted(_steps(checkpoints_dir), reverse=True):
        path = checkpoints_dir / f"step_{step}"
        problem = verify(path)
        if problem is None:
            try:
                state = torch.load(path / "trainer_state.pt", weights_only=False)
                weights: dict[str, torch.Tensor] = {}
                for shard in sorted((path / "model").glob("*.safetensors")):
                    weights.update(load_file(shard))
                missing, unexpected = model.load_state_dict(weights, strict=False)
                # tied weights (lm_head = embeddings) are saved once; anything else missing is damage
                tied = set(getattr(model, "_tied_weights_keys", None) or [])
                if unexpected or set(missing) - tied:
                    raise ValueError(f"weights do not fit the model (missing {missing}, unexpected {unexpected})")
                if hasattr(model, "tie_weights"):
                    model.tie_weights()
                return step, state
            except Exception as error:  # noqa: BLE001 - any damage means: try the next one
                problem = f"failed to load ({error})"
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None
