"""MLflow: one experiment and parent run per study, one child run per grid point, idempotent sync.

The run directories are the truth and MLflow is a view of them: `sync` can run any number of times,
concurrently, or after a tracking outage, and ends with every step logged exactly once. Steps
already in MLflow are read back from the history of `reward_mean` (every metrics line has it), and
new steps go in batches of whole steps, each batch one transaction.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from sweep import study_page  # what the UI shows of the study
from sweep.axes import flatten
from sweep.runs import RunRecord, load_runs

log = logging.getLogger(__name__)

ANCHOR = "reward_mean"  # a metric every metrics.jsonl line carries
MAX_BATCH = 1000        # MLflow's limit of metrics per log_batch
MAX_PARAM = 6000        # MLflow's limit of a param value's length
TAG_ROLE, TAG_STUDY, TAG_RUN = "klstudy.role", "klstudy.study", "klstudy.run_id"
TAG_SET_UP = "klstudy.set_up"  # a child run's params, label and config are all logged
# MLflow 3's UI opens an experiment of this kind on its training runs, not on GenAI traces
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def default_uri(results: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else sqlite:///<results>/mlflow.db."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(results).resolve() / 'mlflow.db'}"


@contextmanager
def sync_lock(results: Path) -> Iterator[None]:
    """One sync at a time per results directory (so no two create the same run)."""
    Path(results).mkdir(parents=True, exist_ok=True)
    with open(Path(results) / ".mlflow-sync.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class SyncReport:
    runs_created: int = 0
    steps_logged: int = 0
    evals_logged: int = 0
    artifacts_logged: int = 0
    parent_run_id: str = ""
    child_run_ids: dict[str, str] = field(default_factory=dict)
    runs_page: str = ""


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store


class TrackingAccessError(ValueError):
    """The tracking server refused this client: no credentials, or wrong ones."""


def public_uri(uri: str) -> str:
    """`uri` without credentials written into it (http://user:password@host): what logs and result
    files may show. MLflow's own variables, MLFLOW_TRACKING_USERNAME and _PASSWORD, are the way to
    pass them; klstudy never reads, logs or stores them."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))


def _check_access(error: Exception, uri: str) -> None:
    """A 401/403 from the server as one error that says what to set (anything else: raised as is)."""
    if getattr(error, "error_code", None) in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        raise TrackingAccessError(
            f"the tracking server {public_uri(uri)} refused access ({error.error_code}): set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to an account that may write this "
            "study's experiment") from None


def runs_page(uri: str, experiment_id: str) -> str:
    """The MLflow UI page that compares the study's runs: every grid point as a row, the columns that
    matter (sweep.study_page). A local store has no server: the page is where
    `mlflow ui --backend-store-uri <uri>` serves it."""
    base = public_uri(uri).rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI
    return study_page.runs_page(base, experiment_id)


def client_for(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _find_run(client, experiment_id: str, tags: dict[str, str]):
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    found = client.search_runs([experiment_id], filter_string=query, max_results=2)
    return found[0] if found else None


def artifact_location(results: Path, uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a local store, <results>/mlartifacts.

    Without it a sqlite store puts them in ./mlruns of whatever directory the sync runs from.
    A tracking server decides for itself (None).
    """
    if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        return (Path(results).resolve() / "mlartifacts").as_uri()
    return None


def study_run(client, study: str, artifacts: str | None = None) -> tuple[str, str]:
    """(experiment id, parent run id) of a study, created if absent (artifacts under `artifacts`)."""
    name = f"klstudy/{study}"
    experiment = client.get_experiment_by_name(name)
    experiment_id = (experiment.experiment_id if experiment
                     else client.create_experiment(name, artifact_location=artifacts))
    if experiment is None or experiment.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
        client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
    tags = {TAG_ROLE: "study", TAG_STUDY: study}
    parent = _find_run(client, experiment_id, tags)
    if parent is None:
        parent = client.create_run(experiment_id, tags=tags, run_name=study)
    return experiment_id, parent.info.run_id


def open_study(results: Path, study: str, uri: str):
    """(client, experiment id, parent run id) of a study in the store at `uri`; a server that refuses
    this client raises TrackingAccessError, which says what to set."""
    client = client_for(uri)
    try:
        experiment_id, parent_id = study_run(client, study, artifact_location(results, uri))
    except Exception as error:  # noqa: BLE001 - MlflowException; a refusal shows on this first call
        _check_access(error, uri)
        raise
    return client, experiment_id, parent_id


def _params(record: RunRecord):
    from mlflow.entities import Param

    return [Param(k, str(v)[:MAX_PARAM]) for k, v in sorted(flatten(record.config).items())]


def coordinate_tags(record: RunRecord) -> dict[str, str]:
    """klstudy.<axis> for every axis: model, estimator, placement, beta, seed and the study's extra axes
    (klstudy.train.async_level), so that the UI filters and groups runs by any of them."""
    return {f"klstudy.{axis}": str(value) for axis, value in record.coords.items()}


def _update_coordinate_tags(client, run_id: str, run_tags: dict[str, str], record: RunRecord) -> None:
    """The extra axes are known from the runs present: a run synced before its study's other runs
    existed gets the tags of the axes found since."""
    from mlflow.entities import RunTag

    stale = [RunTag(k, v) for k, v in coordinate_tags(record).items() if run_tags.get(k) != v]
    if stale:
        client.log_batch(run_id, tags=stale)


def _child_run(client, experiment_id: str, parent_id: str, record: RunRecord, report: SyncReport) -> str:
    """The run's MLflow child run, created and set up if need be.

    Setting up takes several calls (params, label, config artifact); the tag TAG_SET_UP comes last.
    A child run without it (a sync interrupted in between) is set up again: every call is
    idempotent, so any interruption converges to the full state."""
    from mlflow.entities import RunTag

    tags = {TAG_ROLE: "grid-point", TAG_RUN: record.run_id}
    existing = _find_run(client, experiment_id, tags)
    if existing is not None and existing.data.tags.get(TAG_SET_UP) == "1":
        return existing.info.run_id
    if existing is None:
        tags |= {**coordinate_tags(record), "mlflow.parentRunId": parent_id}
        run_id = client.create_run(experiment_id, run_name=record.run_id, tags=tags).info.run_id
        report.runs_created += 1
    else:
        run_id = existing.info.run_id
    params = _params(record)
    for start in range(0, len(params), 100):
        client.log_batch(run_id, params=params[start:start + 100])
    client.log_batch(run_id, tags=[RunTag("klstudy.config_label", record.label)])
    client.log_artifact(run_id, str(record.path / "config.yaml"))
    report.artifacts_logged += 1
    client.set_tag(run_id, TAG_SET_UP, "1")
    return run_id


def _log_steps(client, run_id: str, record: RunRecord, report: SyncReport) -> None:
    from mlflow.entities import Metric

    synced = {m.step for m in client.get_metric_history(run_id, ANCHOR)}
    pending = [line for line in record.metrics if line["step"] not in synced]
    batch: list = []
    now = int(time.time() * 1000)

    def flush() -> None:
        if batch:
            client.log_batch(run_id, metrics=list(batch))
            batch.clear()

    for line in pending:
        step_metrics = [Metric(k, float(v), now, int(line["step"])) for k, v in line.items()
                        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(float(v))]
        if len(batch) + len(step_metrics) > MAX_BATCH:
            flush()  # whole steps per batch: a crash leaves no step half-logged
        batch.extend(step_metrics)
    flush()
    report.steps_logged += len(pending)


def _log_objective(client, run_id: str, record: RunRecord) -> None:
    """The measured objective (objective.jsonl) as metrics objective/<key> at the measured steps."""
    from mlflow.entities import Metric

    synced = {m.step for m in client.get_metric_history(run_id, "objective/kl")}
    now = int(time.time() * 1000)
    for line in record.objective:
        if line["step"] not in synced:
            client.log_batch(run_id, metrics=[Metric(f"objective/{k}", float(v), now, int(line["step"]))
                                              for k, v in line.items() if k != "step" and isinstance(v, (int, float))
                                              and math.isfinite(float(v))])


def _digest(scores: dict) -> str:
    """Of the scores as read and logged (not of the file now, which an evaluation may have rewritten)."""
    return hashlib.sha256(json.dumps(scores, sort_keys=True).encode()).hexdigest()[:16]


def _log_evals(client, run_id: str, run_tags: dict[str, str], record: RunRecord, report: SyncReport) -> None:
    """Eval scores as metrics at the evaluated step (the final model's at the run's last step); each is
    re-logged only when its metrics.json changed."""
    from mlflow.entities import Metric, RunTag

    now = int(time.time() * 1000)
    for evaluation in record.evaluations():
        step, suite, where, eval_dir = evaluation.step, evaluation.suite, evaluation.where, evaluation.directory
        digest, tag = _digest(evaluation.scores), f"klstudy.eval_digest.{where.replace('/', '.')}"
        if run_tags.get(tag) == digest:
            continue
        values = []
        for task, row in evaluation.scores.get("tasks", {}).items():
            values.append(Metric(f"eval/{suite}/{task}/pass_at_1", float(row["value"]), now, step))
            if row.get("stderr") is not None:
                values.append(Metric(f"eval/{suite}/{task}/pass_at_1_stderr", float(row["stderr"]), now, step))
            if "pass@k" in row:
                values.append(Metric(f"eval/{suite}/{task}/pass_at_{row['pass@k']['k']}",
                                     float(row["pass@k"]["value"]), now, step))
        client.log_batch(run_id, metrics=values, tags=[RunTag(tag, digest)])
        if (eval_dir / "samples.jsonl").exists():
            client.log_artifact(run_id, str(eval_dir / "samples.jsonl"), artifact_path=f"eval/{where}")
            report.artifacts_logged += 1
        report.evals_logged += 1


def _log_curves(client, run_id: str, record: RunRecord, report: SyncReport, new_steps: bool) -> None:
    if not new_steps or not record.metrics:
        return
    from sweep.figures import run_curves_figure  # matplotlib only when there is something to draw

    with tempfile.TemporaryDirectory() as tmp:
        path = run_curves_figure(record, Path(tmp) / "curves.png")
        client.log_artifact(run_id, str(path))
    report.artifacts_logged += 1


def sync(results: Path, study: str, uri: str | None = None) -> SyncReport:
    """Bring MLflow up to date with every run under `results`; safe to repeat and to run concurrently."""
    results = Path(results)
    uri = uri or default_uri(results)
    report = SyncReport()
    with sync_lock(results):
        client, experiment_id, parent_id = open_study(results, study, uri)
        report.parent_run_id, report.runs_page = parent_id, runs_page(uri, experiment_id)
        for record in (records := load_runs(results)):
            run_id = _child_run(client, experiment_id, parent_id, record, report)
            report.child_run_ids[record.run_id] = run_id
            before = report.steps_logged
            run = client.get_run(run_id)
            _update_coordinate_tags(client, run_id, run.data.tags, record)
            _log_steps(client, run_id, record, report)
            _log_evals(client, run_id, run.data.tags, record, report)
            _log_objective(client, run_id, record)
            _log_curves(client, run_id, record, report, report.steps_logged > before)
            study_page.show_grid_point(client, run_id, run.data.tags, record)
            if record.complete and run.info.status != "FINISHED":
                client.set_terminated(run_id, "FINISHED")
        study_page.publish_views(client, experiment_id, records)
    log.info("synced %s into %s: %d runs created, %d steps, %d evals", results, public_uri(uri), report.runs_created,
             report.steps_logged, report.evals_logged)
    log.info("the study's runs in MLflow: %s%s", report.runs_page,
             "" if uri.startswith(("http://", "https://")) else f" (after: mlflow ui --backend-store-uri {uri})")
    return report


def follow(results: Path, study: str, run_dir: Path, uri: str | None = None, interval: float = 30.0,
           max_wait: float | None = None) -> None:
    """Sync every `interval` s until `run_dir` is complete; a tracking outage only delays the view."""
    start = time.monotonic()
    while True:
        done = (Path(run_dir) / "COMPLETE").exists()
        try:
            sync(results, study, uri)
        except TrackingAccessError:
            raise  # retrying cannot help
        except Exception as error:  # noqa: BLE001 - tracking down: the next round catches up
            shown = str(error).replace(uri, public_uri(uri)) if uri else str(error)
            log.warning("tracking sync failed (%s); retrying in %.0f s", shown, interval)
        if done or (max_wait is not None and time.monotonic() - start > max_wait):
            return
        time.sleep(interval)
