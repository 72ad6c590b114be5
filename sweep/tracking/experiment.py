"""MLflow: one experiment and parent run per study, one child run per grid point, idempotent sync.

The run directories are the truth and MLflow is a view of them. `sync` brings MLflow up to date with
some runs (a training job's follower: its own) or with all of them (the study's track job), any
number of times, concurrently, from any node, or after a tracking outage, and ends with one child
run per grid point and every step logged once (sweep.tracking.run_sync). What has been synced is recorded
beside each run (sweep.tracking.sync_records), so a round finds what is new in local files: a run with
nothing new costs the server nothing. No lock is shared between processes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

from sweep.runs import load_runs, study_axes
from sweep.tracking import study_page, sync_records  # study_page: what the UI shows of the study
from sweep.tracking.concurrent_tags import set_experiment_tag
from sweep.tracking.run_sync import (
    TAG_ROLE,
    TAG_STUDY,
    Store,
    SyncReport,
    active_run,
    claim_run,
    find_runs,
    study_children,
    sync_run,
)
from trainer.run_files import COMPLETE

log = logging.getLogger(__name__)

# MLflow 3's UI opens an experiment of this kind on its training runs, not on GenAI traces
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
IN_FLIGHT = 16  # runs whose metrics may be on their way (MLFLOW_ENABLE_ASYNC_LOGGING) during a whole sync


def default_uri(results: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else sqlite:///<results>/mlflow.db."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(results).resolve() / 'mlflow.db'}"


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store


class TrackingAccessError(ValueError):
    """The tracking server refused this client: no credentials, wrong ones, or a host name it does not allow."""


# What MLflow 3's server answers (403) to a Host header that is not localhost or a private IP and is not in
# its --allowed-hosts: its guard against DNS rebinding (mlflow/server/security_utils.py, INVALID_HOST_MSG)
HOST_NOT_ALLOWED = "Invalid Host header - possible DNS rebinding attack detected"


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


def host_header(uri: str) -> str:
    """The Host header a client of `uri` sends: its host name, and its port when the URI names one."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname or ""
    return host + (f":{parts.port}" if parts.port else "")


def _check_access(error: Exception, uri: str) -> None:
    """A 401/403 from the server as one error that says what to set or start (anything else: raised as is)."""
    if getattr(error, "error_code", None) == "PERMISSION_DENIED" and HOST_NOT_ALLOWED in str(error):
        host = host_header(uri)
        raise TrackingAccessError(
            f"the tracking server {public_uri(uri)} does not allow the host name {host} that this client "
            f"reaches it by (MLflow allows only localhost and private IPs by default): start it with "
            f"`mlflow server ... --allowed-hosts {host}`, adding any other name it is reached by "
            "(localhost:* for a tunnel)") from None
    if getattr(error, "error_code", None) in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        raise TrackingAccessError(
            f"the tracking server {public_uri(uri)} refused access ({error.error_code}): set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to an account that may write this "
            "study's experiment") from None


def runs_page(uri: str, experiment_id: str) -> str:
    """The MLflow UI page that compares the study's runs: every grid point as a row, the columns that
    matter (sweep.tracking.study_page). A local store has no server: the page is where
    `mlflow ui --backend-store-uri <uri>` serves it."""
    base = public_uri(uri).rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI
    return study_page.runs_page(base, experiment_id)


def client_for(uri: str):
    """A client of the store at `uri`. A new sqlite store is created (MLflow's schema migrations) under a
    lock beside its file: two processes creating one at once collide. A sqlite file belongs to one
    machine, so the lock is that machine's; servers need none."""
    from mlflow.tracking import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    database = Path(uri[len("sqlite:///"):])
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(database.name + ".create.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        return MlflowClient(tracking_uri=uri)  # creates and migrates the store, once per process


def artifact_location(results: Path, uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a local store, <results>/mlartifacts.

    Without it a sqlite store puts them in ./mlruns of whatever directory the sync runs from.
    A tracking server decides for itself (None).
    """
    if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        return (Path(results).resolve() / "mlartifacts").as_uri()
    return None


class TrackingUnreachable(ValueError):
    """The tracking server does not answer."""


def _check_reachable(error: Exception, uri: str) -> None:
    """A server that does not answer (after MLflow's own retries) as one error that says what to do."""
    text = str(error)
    if any(sign in text for sign in ("Max retries exceeded", "Connection refused", "Failed to establish",
                                     "Read timed out", "Name or service not known")):
        raise TrackingUnreachable(
            f"the tracking server {public_uri(uri)} does not answer ({_cause(text)}): start it, or point "
            "tracking.uri in the study config (else MLFLOW_TRACKING_URI) at one that runs") from None


def _cause(text: str) -> str:
    for sign in ("Connection refused", "Read timed out", "Name or service not known", "Max retries exceeded"):
        if sign in text:
            return sign.lower()
    return "no answer"


def _study_claim(client, study: str, artifacts: str | None, directory: Path, generation: int,
                 stale: set[str]) -> dict:
    """The study's experiment (created if absent) and its parent run, claimed (sweep.tracking.sync_records)."""
    from mlflow.exceptions import MlflowException

    name = f"klstudy/{study}"
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            client.create_experiment(name, artifact_location=artifacts)
        except MlflowException as error:  # another process created it first
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id
    if experiment.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
        set_experiment_tag(client, experiment_id, *EXPERIMENT_KIND)
    tags = {TAG_ROLE: "study", TAG_STUDY: study}
    held, _ = claim_run(client, directory, "study", generation, stale,
                        find=lambda: find_runs(client, experiment_id, tags),
                        create=lambda: client.create_run(experiment_id, tags=tags, run_name=study),
                        describe=lambda run: {"run_id": run.info.run_id, "experiment_id": experiment_id})
    return held


def open_store(results: Path, study: str, uri: str, verify: bool = True) -> Store:
    """The study in the store at `uri`, from its record in <results>/tracking; created, or checked
    against the server (`verify`), when needed. A server that refuses this client raises
    TrackingAccessError, one that does not answer TrackingUnreachable: each says what to do."""
    client = client_for(uri)
    key = sync_records.store_key(public_uri(uri), study)
    directory = sync_records.records_dir(Path(results) / "tracking", key)
    try:
        claim = sync_records.latest_claim(directory, "study")
        generation, held, stale = 0, None, set()
        if claim is not None:
            generation, held = claim
            if verify and active_run(client, held["run_id"]) is None:
                generation, held, stale = generation + 1, None, {held["run_id"]}
        if held is None:
            held = _study_claim(client, study, artifact_location(results, uri), directory, generation, stale)
    except Exception as error:  # noqa: BLE001 - MlflowException; a refusal shows on the first call
        _check_access(error, uri)
        _check_reachable(error, uri)
        raise
    return Store(client, key, held["experiment_id"], held["run_id"])


def open_study(results: Path, study: str, uri: str):
    """(client, experiment id, parent run id) of a study in the store at `uri` (see open_store)."""
    store = open_store(results, study, uri)
    return store.client, store.experiment_id, store.parent_id


def sync(results: Path, study: str, uri: str | None = None, runs: list[Path] | None = None,
         verify: bool | None = None) -> SyncReport:
    """Bring MLflow up to date with `runs` (run directories: a follower's own), or with every run under
    `results` (the track job: then each run's record is also checked against the server, the study's
    runs read in pages of 1,000, unless `verify` says otherwise). Safe to repeat and to run
    concurrently, from any node."""
    results = Path(results)
    uri = uri or default_uri(results)
    everything = runs is None
    verify = everything if verify is None else verify
    report = SyncReport()
    store = open_store(results, study, uri, verify)
    report.parent_run_id, report.runs_page = store.parent_id, runs_page(uri, store.experiment_id)
    records = load_runs(results) if everything else load_runs(results, only=runs)
    if not everything and any(not sync_records.read_state(sync_records.run_records(results, r.run_id, store.key))
                              .get("tags") for r in records):
        axes = study_axes(results)  # a new child's tags: the extra axes of the runs there so far
        for record in records:
            record.extra_axes = axes
    in_flight: deque = deque()
    try:
        known = study_children(store.client, store.experiment_id) if verify and len(records) > 1 else None
        for record in records:
            in_flight.append(sync_run(store, record, report, verify, whole=everything, asynchronous=everything,
                                      known=known))
            while len(in_flight) > (IN_FLIGHT if everything else 0):
                in_flight.popleft()()
        while in_flight:
            in_flight.popleft()()
        if everything or report.runs_created:  # the track job, or a follower whose run is new: not per round
            study_page.publish_views(store.client, store.experiment_id, records)
    except Exception as error:  # noqa: BLE001 - the server went away mid-sync: one error that says so
        _check_access(error, uri)
        _check_reachable(error, uri)
        raise
    if everything:
        log.info("synced %s into %s: %d runs created, %d steps, %d evals", results, public_uri(uri),
                 report.runs_created, report.steps_logged, report.evals_logged)
        log.info("the study's runs in MLflow: %s%s", report.runs_page, "" if uri.startswith(("http://", "https://"))
                 else f" (after: mlflow ui --backend-store-uri {uri})")
    return report


def follow(results: Path, study: str, run_dirs: Path | list[Path], uri: str | None = None, interval: float = 30.0,
           max_wait: float | None = None, ended: threading.Event | None = None) -> None:
    """Sync a training job's runs every `interval` s until all are complete, or until `ended` is set (the
    job's training is over), then once more. A tracking outage only delays the view; after a failed round,
    the next checks the records against the server."""
    run_dirs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(d) for d in run_dirs]
    start, verify, ended = time.monotonic(), False, ended or threading.Event()
    while True:
        done = ended.is_set() or all((run / COMPLETE).exists() for run in run_dirs)
        try:
            sync(results, study, uri, runs=run_dirs, verify=verify)
            verify = False
        except TrackingAccessError:
            raise  # retrying cannot help
        except Exception as error:  # noqa: BLE001 - tracking down: the next round catches up
            shown = str(error).replace(uri, public_uri(uri)) if uri else str(error)
            log.warning("tracking sync failed (%s); retrying in %.0f s", shown, interval)
            verify = True
        if done or (max_wait is not None and time.monotonic() - start > max_wait):
            return
        ended.wait(interval)
