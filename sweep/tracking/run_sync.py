"""One run into MLflow: its child run, claimed once, and what is new in its directory since the last sync.

`sync_run` reads the run's synced-state record (sweep.tracking.sync_records) and its files. When they agree
and nothing is new, it asks the server nothing. When the record is missing or does not match (a
first sync, a run resumed from an earlier checkpoint that rewrote its last lines, a record written
for another store), it reads back from the server what the run holds and logs the rest.

Any number of processes may sync a run at once. Its child run is the one whose claim was published
first; a process that created another deletes it. Every metric goes in with a timestamp derived
from the run's files (the child's start time plus the run's step times), so a step logged by two
processes is the same row and the store keeps it once.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sweep.runs import RunRecord
from sweep.study.axes import flatten
from sweep.tracking import study_page, sync_records
from trainer.run_files import METRICS, OBJECTIVE

ANCHOR = "reward_mean"  # a metric every metrics.jsonl line carries
OBJECTIVE_ANCHOR = "objective/kl"  # and every objective.jsonl line
MAX_BATCH = 1000        # MLflow's limit of metrics per log_batch
MAX_PARAMS = 100        # and of params, or tags
MAX_PARAM = 6000        # MLflow's limit of a param value's length
TAG_ROLE, TAG_STUDY, TAG_RUN = "klstudy.role", "klstudy.study", "klstudy.run_id"
TAG_SET_UP = "klstudy.set_up"  # a child run's params and config are logged
TAG_LABEL = "klstudy.config_label"
TAG_CONFIG_DIGEST = "klstudy.config_digest"  # the run's identity (trainer.config.digest): equal configs, equal tag


@dataclass
class SyncReport:
    runs_created: int = 0
    steps_logged: int = 0
    evals_logged: int = 0
    artifacts_logged: int = 0
    parent_run_id: str = ""
    child_run_ids: dict[str, str] = field(default_factory=dict)
    runs_page: str = ""


@dataclass(frozen=True)
class Store:
    """An opened study: where its runs go, and the key of its records."""

    client: Any
    key: str
    experiment_id: str
    parent_id: str


def find_runs(client, experiment_id: str, tags: dict[str, str]) -> list:
    """The experiment's active runs with these tags, oldest first."""
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    found = client.search_runs([experiment_id], filter_string=query, max_results=100)
    return sorted(found, key=lambda run: (run.info.start_time or 0, run.info.run_id))


def active_run(client, run_id: str):
    """The run, or None if it was deleted or never existed on this server."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return run if run.info.lifecycle_stage == "active" else None


def claim_run(client, directory: Path, name: str, generation: int, stale: set[str],
              find: Callable[[], list], create: Callable[[], Any],
              describe: Callable[[Any], dict]) -> tuple[dict, bool]:
    """The MLflow run that claim `name` of `generation` names: an existing one found by its tags (the
    oldest), else one created here, published unless someone published first (then a run created
    here is deleted). (claim, whether this call created the run the claim names)."""
    found = [run for run in find() if run.info.run_id not in stale]
    candidate, created = (found[0], False) if found else (create(), True)
    held = sync_records.publish_claim(directory, name, generation, describe(candidate))
    if held["run_id"] != candidate.info.run_id:
        if created:
            client.delete_run(candidate.info.run_id)
        return held, False
    return held, created


def coordinate_tags(record: RunRecord) -> dict[str, str]:
    """klstudy.<axis> for every axis: model, estimator, placement, beta, seed and the study's extra axes
    (klstudy.train.async_level), so that the UI filters and groups runs by any of them."""
    return {f"klstudy.{axis}": str(value) for axis, value in record.coords.items()}


def wanted_tags(record: RunRecord) -> dict[str, str]:
    digest = {TAG_CONFIG_DIGEST: record.config_digest} if record.config_digest else {}
    return coordinate_tags(record) | {TAG_LABEL: record.label} | digest | study_page.grid_point_tags(record)


def _params(record: RunRecord):
    from mlflow.entities import Param

    return [Param(k, str(v)[:MAX_PARAM]) for k, v in sorted(flatten(record.config).items())]


def study_children(client, experiment_id: str) -> dict[str, Any]:
    """run id -> every active grid-point run of the study's experiment, read in pages of 1,000: what a
    whole-study sync checks its records against, in a few requests rather than one per run."""
    found, token = {}, None
    while True:
        page = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_ROLE}` = 'grid-point'",
                                  max_results=1000, page_token=token)
        found.update({run.info.run_id: run for run in page})
        token = page.token
        if not token:
            return found


def _child(store: Store, record: RunRecord, directory: Path, verify: bool, report: SyncReport,
           known: dict[str, Any] | None = None):
    """(claim, the run if read from the server, whether this call created it). `known`: the study's child
    runs as a search just read them; one missing there (created since) is asked for on its own."""
    client = store.client
    claim = sync_records.latest_claim(directory, "child")
    generation, stale = 0, set()
    if claim is None or claim[1].get("run_id") in sync_records.retired(directory):
        # a new grid point, or one rerun from scratch (sweep.study.rerun retired its child): a new child
        stale = _delete_retired(client, directory)
        generation = 0 if claim is None else claim[0] + 1
    else:
        generation, held = claim
        if held.get("experiment_id") == store.experiment_id:
            if not verify:
                return held, None, False
            run = (known or {}).get(held["run_id"]) or active_run(client, held["run_id"])
            if run is not None:
                return held, run, False
        generation, stale = generation + 1, {held["run_id"]}

    def create():
        tags = {TAG_ROLE: "grid-point", TAG_RUN: record.run_id, "mlflow.parentRunId": store.parent_id,
                **wanted_tags(record)}
        return client.create_run(store.experiment_id, run_name=record.run_id, tags=tags)

    held, created = claim_run(
        client, directory, "child", generation, stale,
        find=lambda: find_runs(client, store.experiment_id, {TAG_ROLE: "grid-point", TAG_RUN: record.run_id}),
        create=create,
        describe=lambda run: {"run_id": run.info.run_id, "start_time": run.info.start_time,
                              "experiment_id": store.experiment_id})
    report.runs_created += created
    return held, None, created


def _delete_retired(client, directory: Path) -> set[str]:
    """The child runs of a discarded earlier run directory of this grid point (sweep.study.rerun), deleted
    (MLflow keeps them restorable) so that the study shows one row per point."""
    from mlflow.exceptions import MlflowException

    retired = sync_records.retired(directory)
    for run_id in retired:
        if active_run(client, run_id) is not None:
            try:
                client.delete_run(run_id)
            except MlflowException as error:  # another sync deleted it first
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
    return retired


def _read_back(run, record: RunRecord) -> dict[str, Any]:
    """A state from what the server holds (the steps: read when needed)."""
    tags = run.data.tags
    evals = {e.where: tags[_eval_tag(e.where)] for e in record.evaluations() if _eval_tag(e.where) in tags}
    return {"child": run.info.run_id, "set_up": tags.get(TAG_SET_UP) == "1",
            "tags": {k: tags.get(k) for k in wanted_tags(record)}, "evals": evals,
            "finished": run.info.status == "FINISHED"}


def _agrees(state: dict[str, Any], run, record: RunRecord) -> bool:
    """Whether the server holds what the state says (one get_run: tags, status, the newest metrics)."""
    tags, latest = run.data.tags, run.data.metrics
    metrics = state.get("metrics") or [0, ""]
    last = record.metrics[metrics[0] - 1] if 0 < metrics[0] <= len(record.metrics) else None
    return ((tags.get(TAG_SET_UP) == "1") == bool(state.get("set_up"))
            and (run.info.status == "FINISHED") == bool(state.get("finished"))
            and all(tags.get(_eval_tag(where)) == digest for where, digest in state.get("evals", {}).items())
            and (last is None or _finite(latest.get(ANCHOR)) == _finite(last.get(ANCHOR))))


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None
    return float(value)


def _stamps(lines: list[dict[str, Any]], t0: int) -> dict[int, int]:
    """step -> the timestamp (ms) its metrics go in with: the child's start plus the step times up to
    it; the same for every process that reads the same file, and increasing."""
    stamps, elapsed, last = {}, 0.0, t0
    for line in lines:
        elapsed += _finite(line.get("step_time")) or 0.0
        last = max(last + 1, t0 + int(1000 * elapsed))
        stamps[int(line["step"])] = last
    return stamps


def _metrics(line: dict[str, Any], stamp: int, prefix: str = ""):
    from mlflow.entities import Metric

    step = int(line["step"])
    return [Metric(prefix + k, value, stamp, step) for k, v in line.items()
            if k not in ("step", "per_prompt") and (value := _finite(v)) is not None]


def _pending(lines: list[dict[str, Any]], path: Path, synced: list | None, logged_steps: Callable[[], set[int]]):
    """The lines not yet in MLflow: after the synced count when its digest still matches the file;
    else those whose step the server does not show."""
    if synced is not None and synced[0] <= len(lines) and sync_records.lines_digest(path, synced[0]) == synced[1]:
        return lines[synced[0]:]
    steps = logged_steps()
    return [line for line in lines if int(line["step"]) not in steps]


def _batches(groups: list[list]) -> list[list]:
    """Whole steps per batch, at most MAX_BATCH metrics each: a crash leaves no step half-logged."""
    batches: list[list] = [[]]
    for group in groups:
        if batches[-1] and len(batches[-1]) + len(group) > MAX_BATCH:
            batches.append([])
        batches[-1].extend(group)
    return [batch for batch in batches if batch]


def _eval_tag(where: str) -> str:
    return f"klstudy.eval_digest.{where.replace('/', '.')}"


def _made_by_tag(where: str) -> str:
    """Of what made the evaluation (eval.provenance.digest), where _eval_tag's is of its scores."""
    return f"klstudy.eval_made_by.{where.replace('/', '.')}"


def _digest(scores: dict) -> str:
    """Of the scores as read and logged (not of the file now, which an evaluation may have rewritten)."""
    return hashlib.sha256(json.dumps(scores, sort_keys=True).encode()).hexdigest()[:16]


def _log_evals(client, run_id: str, state: dict, record: RunRecord, stamps: dict[int, int], t0: int,
               report: SyncReport) -> None:
    """Eval scores as metrics at the evaluated step (the final model's at the run's last step); each is
    logged again only when its metrics.json changed."""
    from mlflow.entities import Metric, RunTag

    evals = state.setdefault("evals", {})
    for evaluation in record.evaluations():
        step, suite, where, eval_dir = evaluation.step, evaluation.suite, evaluation.where, evaluation.directory
        digest = _digest(evaluation.scores)
        if evals.get(where) == digest:
            continue
        stamp, values = stamps.get(step - 1, t0 + step), []
        for task, row in evaluation.scores.get("tasks", {}).items():
            values.append(Metric(f"eval/{suite}/{task}/pass_at_1", float(row["value"]), stamp, step))
            if row.get("stderr") is not None:
                values.append(Metric(f"eval/{suite}/{task}/pass_at_1_stderr", float(row["stderr"]), stamp, step))
            if "pass@k" in row:
                values.append(Metric(f"eval/{suite}/{task}/pass_at_{row['pass@k']['k']}",
                                     float(row["pass@k"]["value"]), stamp, step))
        made_by = [RunTag(_made_by_tag(where), evaluation.digest)] if evaluation.digest else []
        client.log_batch(run_id, metrics=values, tags=[RunTag(_eval_tag(where), digest), *made_by])
        if (eval_dir / "samples.jsonl").exists():
            client.log_artifact(run_id, str(eval_dir / "samples.jsonl"), artifact_path=f"eval/{where}")
            report.artifacts_logged += 1
        evals[where] = digest
        report.evals_logged += 1


def _set_up(client, run_id: str, record: RunRecord, report: SyncReport) -> None:
    """The config artifact, then the params, the last batch with the tag that says both are there: a
    child run without it (a sync interrupted in between) is set up again, and every call is idempotent."""
    from mlflow.entities import RunTag

    client.log_artifact(run_id, str(record.path / "config.yaml"))
    report.artifacts_logged += 1
    params = _params(record)
    starts = list(range(0, len(params), MAX_PARAMS)) or [0]
    for start in starts:
        tags = [RunTag(TAG_SET_UP, "1")] if start == starts[-1] else []
        _log_params(client, run_id, params[start:start + MAX_PARAMS], tags)


def _log_params(client, run_id: str, params: list, tags: list) -> None:
    """Params (and tags) in one batch. MLflow's store checks which params a run holds, then inserts the
    rest: two processes setting up one run at once both insert, and the later one fails on the unique
    key (sqlite, and any server in front of it). When the run then holds these very values, the other
    process logged them: only the tags remain to log. Different values are a real conflict, raised."""
    from mlflow.exceptions import MlflowException

    try:
        client.log_batch(run_id, params=params, tags=tags)
    except MlflowException:
        held = client.get_run(run_id).data.params
        if any(held.get(param.key) != param.value for param in params):
            raise
        if tags:
            client.log_batch(run_id, tags=tags)


def _log_curves(client, run_id: str, record: RunRecord, report: SyncReport) -> None:
    from sweep.report.figures import run_curves_figure  # matplotlib only when there is something to draw

    with tempfile.TemporaryDirectory() as tmp:
        path = run_curves_figure(record, Path(tmp) / "curves.png")
        client.log_artifact(run_id, str(path))
    report.artifacts_logged += 1


def sync_run(store: Store, record: RunRecord, report: SyncReport, verify: bool, whole: bool,
             asynchronous: bool = False, known: dict[str, Any] | None = None) -> Callable[[], None]:
    """Log what is new in `record`'s directory into its child run. `verify`: check the record against
    the server (one request, none where `known`, the study's child runs read at once by study_children,
    has the run); `whole`: a sync of the whole study (the track job), which knows the runs' final
    coordinates (tags that differ are logged again) and draws their curves (curves.png; a follower only
    streams metrics); `asynchronous`: metrics may go with MLflow's asynchronous logging.
    Returns what finishes the run's sync: waiting for metrics sent asynchronously, then writing the state."""
    from mlflow.entities import RunTag

    client = store.client
    directory = sync_records.run_records(record.path.parent.parent, record.run_id, store.key)
    claim, run, created = _child(store, record, directory, verify, report, known)
    run_id, t0 = claim["run_id"], int(claim["start_time"])
    report.child_run_ids[record.run_id] = run_id
    state = sync_records.read_state(directory)
    if state.get("child") != run_id:
        if created:
            state = {"child": run_id, "tags": wanted_tags(record), "metrics": [0, ""], "objective": [0, ""]}
        else:
            state = _read_back(run or client.get_run(run_id), record)
    elif verify and not _agrees(state, run or client.get_run(run_id), record):
        state = _read_back(run or client.get_run(run_id), record)
    if not state.get("set_up"):
        _set_up(client, run_id, record, report)
        state["set_up"] = True
    if state.get("tags") is None or (whole and state["tags"] != wanted_tags(record)):
        wanted = wanted_tags(record)
        logged = state.get("tags") or {}
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in wanted.items() if logged.get(k) != v])
        state["tags"] = wanted

    stamps = _stamps(record.metrics, t0)
    history = lambda key: lambda: {m.step for m in client.get_metric_history(run_id, key)}  # noqa: E731
    pending = _pending(record.metrics, record.path / METRICS, state.get("metrics"), history(ANCHOR))
    measured = _pending(record.objective, record.path / OBJECTIVE, state.get("objective"), history(OBJECTIVE_ANCHOR))
    groups = [_metrics(line, stamps[int(line["step"])]) for line in pending]
    groups += [_metrics(line, stamps.get(int(line["step"]) - 1, t0), "objective/") for line in measured]
    # asynchronous: as MLflow's MLFLOW_ENABLE_ASYNC_LOGGING says (off by default: against a sqlite-backed
    # server on 2 cores it was no faster, the server being the bottleneck; a scalable store gains)
    futures = [client.log_batch(run_id, metrics=batch, synchronous=None if asynchronous else True)
               for batch in _batches(groups)]
    report.steps_logged += len(pending)
    _log_evals(client, run_id, state, record, stamps, t0, report)
    if whole and record.complete and record.metrics and state.get("curves") != len(record.metrics):
        _log_curves(client, run_id, record, report)
        state["curves"] = len(record.metrics)
    if record.complete and not state.get("finished"):
        client.set_terminated(run_id, "FINISHED")
        state["finished"] = True
    state["metrics"] = [len(record.metrics), sync_records.lines_digest(record.path / METRICS, len(record.metrics))]
    state["objective"] = [len(record.objective),
                          sync_records.lines_digest(record.path / OBJECTIVE, len(record.objective))]

    def finish() -> None:
        for future in futures:
            if future is not None:
                future.wait()
        sync_records.write_state(directory, state)

    return finish
