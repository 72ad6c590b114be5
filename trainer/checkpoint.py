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
    """Load the newest valid checkpoint's weights into `model`; (step, trainer state) or None.

    A checkpoint is checked whole before any of it is copied: `model` is either the checkpoint's
    weights, every one, or untouched (so a run that finds no valid checkpoint starts from exactly
    its initial weights, as its reference model does)."""
    for step in sorted(_steps(checkpoints_dir), reverse=True):
        path = checkpoints_dir / f"step_{step}"
        problem = verify(path)
        if problem is None:
            try:
                state = torch.load(path / "trainer_state.pt", weights_only=False)
                weights = _checked_weights(path / "model", model)
            except Exception as error:  # noqa: BLE001 - any damage means: try the next one
                problem = f"failed to load ({error})"
            else:
                model.load_state_dict(weights, strict=True)  # every key and shape already matches
                return step, state
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def _checked_weights(model_dir: Path, model) -> dict[str, torch.Tensor]:
    """The checkpoint's weights by `model`'s own names, if they are exactly `model`'s tensors.

    transformers reads the directory, as it wrote it: a tied output layer is saved once, and some
    models (a mixture of experts) are stored under other names and layouts than they have in memory.
    A missing, extra or misshapen tensor raises."""
    dtype = next(model.parameters()).dtype
    loaded, info = type(model).from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    damage = {kind: sorted(map(str, info.get(kind) or [])) for kind in ("missing_keys", "unexpected_keys",
                                                                         "mismatched_keys", "error_msgs")}
    damage = {kind: keys for kind, keys in damage.items() if keys}
    if damage:
        raise ValueError(f"weights do not fit the model: {damage}")
    weights, expected = loaded.state_dict(), model.state_dict()
    if weights.keys() != expected.keys():
        raise ValueError(f"weights do not fit the model: missing {sorted(expected.keys() - weights.keys())}, "
                         f"unexpected {sorted(weights.keys() - expected.keys())}")
    misshapen = [name for name, tensor in weights.items() if tensor.shape != expected[name].shape]
    if misshapen:
        raise ValueError(f"weights do not fit the model: misshapen {misshapen}")
    return weights
