"""What made an evaluation: recorded in its metrics.json, so that a study can compare it with what it would
make now before it trusts it (sweep.study.changes).

Three parts, each compared on its own:
- `settings`: what decides what an evaluation measures: the tasks, the backend, the sampling (samples,
  greedy, temperature and top_p where it samples, max_gen_toks), the limit, the chat template, the dtype and
  the seed. The batch size and the device decide only how it runs: recorded in metrics.json's `settings`,
  never compared, so that moving evaluations to another kind of node redoes none.
- `data`: per task evaluated, the source as given (a file, a study's prepared data set, a hub id) and the sha256
  of a local file's content, so that a file edited in place is seen.
- `model`: the sha256 of a file that names the model it scored, where the caller gives one (a study gives
  its run's COMPLETE record, which a run that trains again writes anew, and which names the run's config
  digest); else of the model's weights.

And `digest`, one sha256 of the three: the evaluation's identity, which the study's report lists beside its
run's config digest for every number it draws from (tables/provenance.csv).

Free of lm-eval and torch: the study reads and compares records without them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from eval.data import is_local

COMPARED = ("tasks", "backend", "samples", "greedy", "temperature", "top_p", "max_gen_toks", "limit",
            "chat_template", "dtype", "seed")
SAMPLING_ONLY = ("temperature", "top_p")  # unused by greedy decoding
WEIGHTS = ("*.safetensors", "*.bin")
NOT_RECORDED = "provenance"  # the key said of an evaluation made before klstudy recorded what made it


def file_digest(path: Path) -> str:
    """sha256 of a file's content, read in blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_identity(source: str) -> dict[str, Any]:
    """A task's data: the source as given and, for a local file that exists, its content's digest."""
    path = Path(source).expanduser()
    local = is_local(source) and path.is_file()
    return {"source": source, "sha256": file_digest(path) if local else None}


def model_identity(model: str, record: Path | None) -> dict[str, Any]:
    """The scored model: the digest of `record` (a file that names the model, such as a run's COMPLETE; None
    while it does not exist), else of its weight files in name order (a directory), else of nothing (a hub id:
    its name is its identity)."""
    if record is not None:
        return {"record": str(record), "sha256": file_digest(record) if Path(record).is_file() else None}
    directory = Path(model).expanduser()
    files = sorted(path for pattern in WEIGHTS for path in directory.glob(pattern)) if directory.is_dir() else []
    if not files:
        return {"name": model, "sha256": None}
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\n{file_digest(path)}\n".encode())
    return {"weights": str(directory), "sha256": digest.hexdigest()}


def settings_record(settings: Any) -> dict[str, Any]:
    """The compared settings of an EvalSettings (temperature and top_p None under greedy decoding)."""
    record = {key: getattr(settings, key) for key in COMPARED}
    record["tasks"] = list(record["tasks"])
    if settings.greedy:
        record.update(dict.fromkeys(SAMPLING_ONLY))
    return record


def record(settings: Any, model_record: Path | None = None,
           identify: Callable[[str], dict[str, Any]] = data_identity) -> dict[str, Any]:
    """What made an evaluation of `settings` (an EvalSettings), for its metrics.json (`identify`: a data
    source's identity, data_identity or a cache of it), with its digest."""
    made = {"settings": settings_record(settings),
            "data": {task: identify(source) for task, source in sorted(settings.data.items())
                     if task in settings.tasks},
            "model": model_identity(settings.model, model_record)}
    return made | {"digest": digest(made)}


def digest(made: dict[str, Any]) -> str:
    """An evaluation's identity: the sha256 of what made it (a `record`) as canonical JSON, its model and
    data by content where they have one (by name where not), so that a results directory moved elsewhere
    keeps its digests."""
    data = {task: part.get("sha256") or part.get("source") for task, part in (made.get("data") or {}).items()}
    model = made.get("model") or {}
    identity = {"settings": made.get("settings"), "data": data,
                "model": model.get("sha256") or model.get("name")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def differences(recorded: dict[str, Any] | None, expected: dict[str, Any], model: bool = True) -> list[str]:
    """The parts of `expected` that `recorded` (a metrics.json's `provenance`) differs in: setting names,
    `data.<task>`, and `model` (with `model`); [NOT_RECORDED] where there is no record."""
    if not isinstance(recorded, dict):
        return [NOT_RECORDED]
    settings = recorded.get("settings") or {}
    keys = [key for key in COMPARED if settings.get(key) != expected["settings"][key]]
    data = recorded.get("data") or {}
    for task in sorted(set(data) | set(expected["data"])):
        was, now = data.get(task) or {}, expected["data"].get(task) or {}
        if was.get("source") != now.get("source") or (now.get("sha256") and was.get("sha256") != now["sha256"]):
            keys.append(f"data.{task}")
    if model and (recorded.get("model") or {}).get("sha256") != expected["model"]["sha256"]:
        keys.append("model")
    return keys
