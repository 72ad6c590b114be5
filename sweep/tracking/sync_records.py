"""What has been synced into MLflow, kept beside each run: a sync reads these local files and asks
the server nothing when they agree with the run directory.

Everything lives under `<dir>/.mlflow/<store>/`, where `<dir>` is `<results>/tracking/runs/<run id>` for a
run (`run_records`: never in the run directory, which nothing writes into once it is finished) or
`<results>/tracking` for the study, and `<store>` names the tracking store and study (`store_key`). Two
kinds of file:

- **Claims**, `<name>.<generation>.json`: which MLflow run is the run's child (or the study's parent
  run). A claim is published once, by whoever links it into place first: a hard link is atomic and
  fails if the name exists, on local disks, NFS and Lustre alike, and it is no lock (nothing is
  held, nothing goes stale). A process that created an MLflow run and lost the race deletes its run.
  A claim whose MLflow run has gone is superseded by the next generation, published the same way.
- **The state**, `state.json`: what has been logged into the claimed run (how many lines of
  metrics.jsonl and objective.jsonl, with a digest of them; the evaluations' digests; the tags;
  whether the run is marked finished). It is replaced atomically. A state lost, stale or written
  by a slower process costs at most one more request: logging is idempotent (a metric with the same
  key, step, timestamp and value is stored once), and a state that does not match the run's files
  sends the sync to the server to read back what is there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

HIDDEN = ".mlflow"


def store_key(uri: str, study: str) -> str:
    """A short name for (tracking store, study); `uri` without credentials (tracking.public_uri)."""
    return hashlib.sha256(f"{uri}\n{study}".encode()).hexdigest()[:16]


def records_dir(base: Path, key: str) -> Path:
    return Path(base) / HIDDEN / key


def run_base(results: Path, run_id: str) -> Path:
    """Where a run's sync records live: under the study's tracking directory, not in the run's own."""
    return Path(results) / "tracking" / "runs" / run_id


def run_records(results: Path, run_id: str, key: str) -> Path:
    """A run's sync records for one store. Records that an older klstudy kept in the run directory itself
    (`<run>/.mlflow/<store>`) are copied here the first time, so that its MLflow child run is kept."""
    directory = records_dir(run_base(results, run_id), key)
    legacy = records_dir(Path(results) / "runs" / run_id, key)
    if not directory.is_dir() and legacy.is_dir():
        tmp = directory.with_name(f".{key}.{uuid.uuid4().hex}")
        shutil.copytree(legacy, tmp)
        try:
            tmp.rename(directory)
        except OSError:  # another process copied them first
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def latest_claim(directory: Path, name: str) -> tuple[int, dict[str, Any]] | None:
    """(generation, content) of the newest claim `name`, or None."""
    generations = []
    for path in directory.glob(f"{name}.*.json") if directory.is_dir() else []:
        number = path.name[len(name) + 1:-len(".json")]
        if number.isdigit():
            generations.append(int(number))
    for generation in sorted(generations, reverse=True):
        content = _read(directory / f"{name}.{generation}.json")
        if content is not None:
            return generation, content
    return None


def publish_claim(directory: Path, name: str, generation: int, content: dict[str, Any]) -> dict[str, Any]:
    """Publish `content` as claim `name` of `generation` unless someone did first; the claim that holds."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{name}.{generation}.json"
    tmp = directory / f".{name}.{generation}.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(content) + "\n")
    try:
        os.link(tmp, final)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    held = _read(final)
    if held is None:
        raise OSError(f"{final}: a claim that cannot be read")
    return held


def read_state(directory: Path) -> dict[str, Any]:
    return _read(directory / "state.json") or {}


def write_state(directory: Path, state: dict[str, Any]) -> None:
    """Replace the state, unless it holds this already (a sync with nothing new writes nothing)."""
    text = json.dumps(state, sort_keys=True) + "\n"
    try:
        if (directory / "state.json").read_text() == text:
            return
    except OSError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".state.{uuid.uuid4().hex}"
    tmp.write_text(text)
    os.replace(tmp, directory / "state.json")


def lines_digest(path: Path, count: int) -> str:
    """sha256 of the first `count` lines of a file (a metrics.jsonl); "" for none."""
    if count <= 0:
        return ""
    try:
        data = path.read_bytes()
    except OSError:
        return "missing"
    return hashlib.sha256(b"\n".join(data.split(b"\n")[:count])).hexdigest()[:32]


def claimed_children(results: Path, run_id: str) -> dict[str, list[str]]:
    """store key -> the MLflow child runs a run's claims name (every generation)."""
    found: dict[str, list[str]] = {}
    claims = [*Path(run_base(results, run_id)).glob(f"{HIDDEN}/*/child.*.json"),
              *(Path(results) / "runs" / run_id).glob(f"{HIDDEN}/*/child.*.json")]  # an older klstudy's
    for claim in sorted(claims):
        content = _read(claim)
        if content and content.get("run_id") and content["run_id"] not in found.get(claim.parent.name, []):
            found.setdefault(claim.parent.name, []).append(content["run_id"])
    return found


def retire(directory: Path, run_ids: list[str]) -> None:
    """Mark MLflow runs as no longer this grid point's (it is rerun from scratch): the next sync deletes
    them and opens a new child run (`retired.json`, beside the claims)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".retired.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(sorted(retired(directory) | set(run_ids))) + "\n")
    os.replace(tmp, directory / "retired.json")


def retired(directory: Path) -> set[str]:
    """The MLflow runs marked as no longer this grid point's."""
    content = _read(directory / "retired.json")
    return set(content) if isinstance(content, list) else set()
