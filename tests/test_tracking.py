"""MLflow sync: sqlite and a real server, idempotency, concurrency, and a tracking outage."""

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import test_workflow
from study_fixture import write_run, write_study

from sweep.tracking.experiment import sync


def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def child_runs(uri, study):
    c = client(uri)
    experiment = c.get_experiment_by_name(f"klstudy/{study}")
    runs = c.search_runs([experiment.experiment_id], max_results=1000)
    return [r for r in runs if r.data.tags.get("klstudy.role") == "grid-point"], \
        [r for r in runs if r.data.tags.get("klstudy.role") == "study"]


def test_sync_into_sqlite_logs_everything_once(tmp_path, monkeypatch):
    results = write_study(tmp_path / "results")
    checkpoint_eval = results / "eval" / "toy__k1-reward__b0.05__s1" / "step_2" / "all"  # evaluate.every
    checkpoint_eval.mkdir(parents=True)
    (checkpoint_eval / "metrics.json").write_text(json.dumps({"tasks": {"math500": {"value": 0.6, "stderr": 0.01}}}))
    objective = {"step": 4, "kl": 0.1, "gap": 0.2, "reward": 0.5, "per_prompt": {"kl": [0.1], "reward": [0.5]}}
    (results / "runs" / "toy__k1-reward__b0.05__s1" / "objective.jsonl").write_text(json.dumps(objective) + "\n")
    monkeypatch.chdir(tmp_path)
    first = sync(results, "fixture")
    assert not (tmp_path / "mlruns").exists()  # artifacts stay with the study, not in the working directory
    assert (results / "mlartifacts").is_dir()
    uri = f"sqlite:///{(results / 'mlflow.db').resolve()}"
    children, parents = child_runs(uri, "fixture")
    assert first.runs_created == 5 and first.steps_logged == 20 and first.evals_logged == 6
    assert len(children) == 5 and len(parents) == 1
    experiment = client(uri).get_experiment_by_name("klstudy/fixture")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on runs
    run = next(r for r in children if r.data.tags["klstudy.run_id"] == "toy__k1-reward__b0.05__s1")
    assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
    assert run.data.tags["klstudy.estimator"] == "k1" and run.data.tags["klstudy.beta"] == "0.05"
    assert run.data.params["objective.placement"] == "reward" and run.data.params["train.seed"] == "1"
    assert run.data.metrics["eval/all/math500/pass_at_1"] == 0.7 and run.info.status == "FINISHED"
    accuracy = client(uri).get_metric_history(run.info.run_id, "eval/all/math500/pass_at_1")
    assert sorted((m.step, m.value) for m in accuracy) == [(2, 0.6), (4, 0.7)]  # checkpoint, then final model
    history = client(uri).get_metric_history(run.info.run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.2), (1, 0.4), (2, 0.6), (3, 0.8)]
    artifacts = {a.path for a in client(uri).list_artifacts(run.info.run_id)}
    assert {"config.yaml", "curves.png", "eval"} <= artifacts

    measured = {m.key: (m.step, m.value) for m in client(uri).get_metric_history(run.info.run_id, "objective/gap")
                + client(uri).get_metric_history(run.info.run_id, "objective/kl")}
    assert measured == {"objective/gap": (4, 0.2), "objective/kl": (4, 0.1)}  # the measured objective

    again = sync(results, "fixture")  # idempotent: nothing new, nothing duplicated
    assert (again.runs_created, again.steps_logged, again.evals_logged) == (0, 0, 0)
    assert len(client(uri).get_metric_history(run.info.run_id, "objective/gap")) == 1
    assert len(client(uri).get_metric_history(run.info.run_id, "reward_mean")) == 4
    assert len(child_runs(uri, "fixture")[0]) == 5

    path = results / "runs" / "toy__k1-reward__b0.05__s1" / "metrics.jsonl"
    with path.open("a") as handle:  # the run went on: only the new steps are added
        handle.write(json.dumps({"step": 4, "reward_mean": 0.9}) + "\n" + json.dumps({"step": 5, "reward_mean": 1.0})
                     + "\n")
    more = sync(results, "fixture")
    assert more.steps_logged == 2
    assert len(client(uri).get_metric_history(run.info.run_id, "reward_mean")) == 6


def test_every_axis_is_a_tag_and_runs_synced_before_an_axis_appeared_get_it(tmp_path):
    results = tmp_path / "results"
    for seed in (0, 1):
        write_run(results, f"toy__k1-loss__b0.05__s{seed}", "k1", "loss", 0.05, seed, [0.2, 0.4], {"math500": 0.5},
                  train={"async_level": 0}, objective={"kl_loss_ratio": "none"})
    uri = f"sqlite:///{(results / 'mlflow.db').resolve()}"
    sync(results, "axes", uri)
    first = child_runs(uri, "axes")[0][0]
    assert "klstudy.train.async_level" not in first.data.tags  # one value so far: not an axis
    write_run(results, "toy__k1-loss__b0.05__async2__s0", "k1", "loss", 0.05, 0, [0.2, 0.1], {"math500": 0.3},
              train={"async_level": 2}, objective={"kl_loss_ratio": "detached"})
    write_run(results, "toy__none__async2__s0", "k1", "none", 0.0, 0, [0.2, 0.1], {"math500": 0.3},
              train={"async_level": 2}, objective={"kl_loss_ratio": "detached"})
    sync(results, "axes", uri)
    tags = {r.data.tags["klstudy.run_id"]: r.data.tags for r in child_runs(uri, "axes")[0]}
    assert {i: t["klstudy.train.async_level"] for i, t in tags.items()} == {
        "toy__k1-loss__b0.05__s0": "0", "toy__k1-loss__b0.05__s1": "0", "toy__k1-loss__b0.05__async2__s0": "2",
        "toy__none__async2__s0": "2"}
    ratio = {i: t["klstudy.objective.kl_loss_ratio"] for i, t in tags.items()}
    assert ratio == {"toy__k1-loss__b0.05__s0": "none", "toy__k1-loss__b0.05__s1": "none",
                     "toy__k1-loss__b0.05__async2__s0": "detached", "toy__none__async2__s0": "None"}  # unused: None
    assert tags["toy__none__async2__s0"]["klstudy.beta"] == "None"


def test_a_sync_interrupted_after_creating_a_child_run_is_completed_by_the_next(tmp_path, monkeypatch):
    """A crash between creating a child run and logging its params left a run without params that
    later syncs found and skipped; now the next sync completes it."""
    import sweep.tracking.run_sync

    results = write_study(tmp_path / "results")
    uri = f"sqlite:///{(results / 'mlflow.db').resolve()}"
    real_params = sweep.tracking.run_sync._params

    def crash(record):
        raise KeyboardInterrupt("the sync was stopped here")

    monkeypatch.setattr(sweep.tracking.run_sync, "_params", crash)
    with pytest.raises(KeyboardInterrupt):
        sync(results, "fixture")
    (half,), _ = child_runs(uri, "fixture")
    assert half.data.params == {} and "klstudy.set_up" not in half.data.tags

    monkeypatch.setattr(sweep.tracking.run_sync, "_params", real_params)
    report = sync(results, "fixture")
    assert report.runs_created == 4  # the interrupted one is completed, not created twice
    children, _ = child_runs(uri, "fixture")
    assert len(children) == 5
    for run in children:
        assert run.data.params.get("objective.placement"), run.data.tags["klstudy.run_id"]
        assert run.data.tags.get("klstudy.config_label")
        assert "config.yaml" in {a.path for a in client(uri).list_artifacts(run.info.run_id)}
        assert client(uri).get_metric_history(run.info.run_id, "reward_mean")
    assert all(run.data.tags.get("klstudy.set_up") == "1" for run in children)


def test_several_processes_syncing_at_once_lose_nothing(tmp_path):
    results = write_study(tmp_path / "results")
    for i in range(6):
        write_run(results, f"extra__s{i}", "k2", "loss", 0.1, i, [0.1 * j for j in range(10)], {"math500": 0.1})
    processes = [subprocess.Popen([sys.executable, "-m", "sweep", "track", "--results", str(results), "--study", "par"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for p in processes:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    uri = f"sqlite:///{(results / 'mlflow.db').resolve()}"
    children, parents = child_runs(uri, "par")
    assert len(parents) == 1 and len(children) == 11
    for run in children:
        steps = [m.step for m in client(uri).get_metric_history(run.info.run_id, "reward_mean")]
        assert sorted(steps) == sorted(set(steps)) and len(steps) in (4, 10)


def _set_up_at_the_barrier(uri, results, run_ids, barrier, errors):
    """One of several processes that set up the same child runs, released together for each."""
    from sweep.runs import load_runs
    from sweep.tracking.run_sync import SyncReport, _set_up

    record = load_runs(Path(results))[0]
    for run_id in run_ids:
        barrier.wait()
        try:
            _set_up(client(uri), run_id, record, SyncReport())
        except Exception as error:  # noqa: BLE001 - reported to the test
            errors.put(f"{type(error).__name__}: {str(error)[:200]}")


def test_processes_setting_up_one_run_at_the_same_moment_all_succeed(tmp_path):
    """MLflow's store reads a run's params, then inserts the missing ones: two processes that set up one
    run at once both insert, and one failed on the unique key (CI saw it; before the fix, 13 of 20
    rounds here). Now the later one finds the same values there and logs only the tag."""
    import multiprocessing

    results = write_study(tmp_path / "results")
    uri = f"sqlite:///{(results / 'mlflow.db').resolve()}"
    experiment = client(uri).create_experiment("race")
    run_ids = [client(uri).create_run(experiment).info.run_id for _ in range(12)]
    context = multiprocessing.get_context("spawn")
    barrier, errors = context.Barrier(4), context.Queue()
    workers = [context.Process(target=_set_up_at_the_barrier, args=(uri, str(results), run_ids, barrier, errors))
               for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == [] and all(worker.exitcode == 0 for worker in workers)
    for run_id in run_ids:
        run = client(uri).get_run(run_id)
        assert run.data.tags["klstudy.set_up"] == "1" and run.data.params["objective.estimator"] == "k1"


def test_a_param_that_differs_from_the_one_logged_is_still_an_error(tmp_path):
    """The race's recovery accepts only the values it meant to log."""
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException

    from sweep.tracking.run_sync import _log_params

    uri = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    run_id = client(uri).create_run(client(uri).create_experiment("conflict")).info.run_id
    client(uri).log_param(run_id, "train.seed", "0")
    _log_params(client(uri), run_id, [Param("train.seed", "0"), Param("train.steps", "4")], [])
    with pytest.raises(MlflowException, match="Changing param values is not allowed"):
        _log_params(client(uri), run_id, [Param("train.seed", "1")], [])
    assert client(uri).get_run(run_id).data.params == {"train.seed": "0", "train.steps": "4"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path, port, *extra, env=None, host="127.0.0.1"):
    """A real server on 127.0.0.1 (or `host`), as docs/mlflow_ui.md starts one (without MLflow's job runner,
    whose 8 processes a study never uses); its access log (one line per request) in tmp_path/server.log."""
    db, artifacts = tmp_path / "server.db", tmp_path / "artifacts"
    env = {**(os.environ if env is None else env), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", str(artifacts), *extra],
        stdout=(tmp_path / "server.log").open("w"), stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError("mlflow server did not start")


def stop_server(process):
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:  # a busy machine
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def rest(port, path, payload=None, headers=None):
    url = f"http://127.0.0.1:{port}/api/2.0/mlflow/{path}"
    request = urllib.request.Request(url, data=json.dumps(payload).encode() if payload is not None else None,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the module's tests (each uses a study of its own): its port and access log."""
    port, directory = free_port(), tmp_path_factory.mktemp("server")
    process = start_server(directory, port)
    yield port, directory / "server.log"
    stop_server(process)


@pytest.fixture
def server(served):
    return served[0]


def requests_served(log):
    """How many requests the server has answered (its access log has a line for each)."""
    return sum(' HTTP/1.1" ' in line for line in log.read_text().splitlines())


def test_sync_into_a_real_mlflow_server_checked_through_its_rest_api(tmp_path, server):
    results = write_study(tmp_path / "results")
    sync(results, "served", uri=f"http://127.0.0.1:{server}")
    sync(results, "served", uri=f"http://127.0.0.1:{server}")
    experiment = rest(server, "experiments/get-by-name?experiment_name=klstudy/served")["experiment"]
    runs = rest(server, "runs/search", {"experiment_ids": [experiment["experiment_id"]], "max_results": 100})["runs"]
    assert len(runs) == 6  # the parent and five grid points, once each after two syncs
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"]["tags"]} for r in runs}
    child = next(run_id for run_id, t in tags.items() if t.get("klstudy.run_id") == "toy__k3-loss__b0.05__s1")
    history = rest(server, f"metrics/get-history?run_id={child}&metric_key=reward_mean")["metrics"]
    assert sorted((m["step"], m["value"]) for m in history) == [(0, 0.2), (1, 0.4), (2, 0.5), (3, 0.5)]


def test_the_study_is_one_click_away_in_a_real_server(tmp_path, server):
    """What the UI can show, checked through the REST API the UI itself calls: the saved view that the
    link opens filters the grid points, which carry their key metrics; the parent run's note is the
    results table, and its artifacts hold the tables and figures."""
    from sweep.report.build import report
    from sweep.tracking.study_page import GRID_POINTS

    uri = f"http://127.0.0.1:{server}"
    results = write_study(tmp_path / "results")
    synced = sync(results, "clicked", uri=uri)
    report(results, "clicked", uri)
    experiment = rest(server, "experiments/get-by-name?experiment_name=klstudy/clicked")["experiment"]
    experiment_id = experiment["experiment_id"]
    assert synced.runs_page == (f"{uri}/#/experiments/{experiment_id}/runs"
                                "?viewStateShareKey=klstudy-grid-points&workflowType=machine_learning")
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
    view = json.loads({t["key"]: t["value"] for t in experiment["tags"]}["mlflow.sharedViewState.klstudy-grid-points"])
    state = json.loads(view["state"])  # what the link opens (tests/test_mlflow_ui.py: what it shows)
    assert state["searchFilter"] == GRID_POINTS and state["selectedColumns"][-2:] == [
        "metrics.`eval/all/math500/pass_at_1`", "metrics.`reward_mean`"]
    with urllib.request.urlopen(f"{uri}/", timeout=10) as page:  # the page the URL's fragment opens in
        assert page.status == 200 and b"<html" in page.read().lower()
    shown = rest(server, "runs/search", {"experiment_ids": [experiment_id], "filter": GRID_POINTS,
                                         "max_results": 100})["runs"]
    assert len(shown) == 5
    for run in shown:
        metrics = {m["key"] for m in run["data"]["metrics"]}
        assert {"reward_mean", "eval/all/math500/pass_at_1"} <= metrics
    parent = rest(server, f"runs/get?run_id={synced.parent_run_id}")["run"]
    note = {t["key"]: t["value"] for t in parent["data"]["tags"]}["mlflow.note.content"]
    assert note.startswith("# clicked") and (results / "tables" / "results.md").read_text() in note
    artifacts = rest(server, f"artifacts/list?run_id={synced.parent_run_id}&path=tables")["files"]
    assert "tables/results.md" in {a["path"] for a in artifacts}


def test_a_followers_round_syncs_its_own_runs_and_one_with_nothing_new_asks_the_server_nothing(tmp_path, served):
    """A training job's follower syncs its runs, not the study: one round on a finished run creates its
    child only, and a round with nothing new sends no request (the run's synced-state record and its
    files agree). It used to sync every run of the study each round, 4 requests per run when nothing
    was new."""
    from sweep.tracking.experiment import follow

    port, log = served
    uri = f"http://127.0.0.1:{port}"
    results = write_study(tmp_path / "results")
    own = write_run(results, "toy__k2-loss__b0.05__s0", "k2", "loss", 0.05, 0, [0.2, 0.3, 0.4, 0.5], {},
                    complete=False)  # training
    follow(results, "own", own, uri, interval=0, max_wait=0)  # one round
    children, parents = child_runs(uri, "own")
    assert [r.data.tags["klstudy.run_id"] for r in children] == [own.name] and len(parents) == 1
    history = client(uri).get_metric_history(children[0].info.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    before = requests_served(log)
    follow(results, "own", own, uri, interval=0, max_wait=0)
    assert requests_served(log) == before

    with (own / "metrics.jsonl").open("a") as handle:  # a new step: one batch
        handle.write(json.dumps({"step": 4, "reward_mean": 0.9, "step_time": 2.0}) + "\n")
    before = requests_served(log)
    sync(results, "own", uri, runs=[own])
    assert requests_served(log) - before == 1
    assert sorted(m.step for m in client(uri).get_metric_history(children[0].info.run_id, "reward_mean")) == \
        [0, 1, 2, 3, 4]


# Each process sees its own flock granted, as on nodes whose shared file system locks node-locally
# (Lustre's localflock) or not at all; the processes start their syncs at the same instant.
NO_SHARED_LOCK = """
import fcntl, runpy, sys, time
fcntl.flock = lambda *args: None
import mlflow.tracking, sweep.tracking.experiment
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
sys.argv = ["sweep", *sys.argv[2:]]
runpy.run_module("sweep", run_name="__main__")
"""


def test_processes_syncing_the_same_runs_at_once_without_a_shared_lock_make_one_child_and_log_each_step_once(
        tmp_path, served):
    """No correctness rests on a lock shared across nodes: each run's child is the one whose claim was
    published first, and a step logged twice is the same row. The flock used to be the only guard:
    without it, two syncs created two children of a run, or logged its steps twice."""
    port, _ = served
    uri = f"http://127.0.0.1:{port}"
    results = tmp_path / "results"
    for i in range(8):
        write_run(results, f"par__s{i}", "k2", "loss", 0.1, i, [0.1 * j for j in range(30)], {"math500": 0.1})
    start = time.time() + 20  # every process has imported MLflow by then
    processes = [subprocess.Popen([sys.executable, "-c", NO_SHARED_LOCK, str(start), "track", "--results",
                                   str(results), "--study", "nolock", "--uri", uri],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in processes:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
    children, parents = child_runs(uri, "nolock")
    assert len(parents) == 1
    assert sorted(r.data.tags["klstudy.run_id"] for r in children) == [f"par__s{i}" for i in range(8)]
    for run in children:
        steps = [m.step for m in client(uri).get_metric_history(run.info.run_id, "reward_mean")]
        assert sorted(steps) == list(range(30)), run.data.tags["klstudy.run_id"]


def test_the_track_job_checks_each_run_against_the_server_and_rebuilds_what_it_lost(tmp_path, served):
    """Records can be wrong (the server's store was replaced, a child run deleted in the UI): the track
    job checks them against one search of the study's runs (a page per 1,000) and rebuilds what is missing;
    followers trust them."""
    port, log = served
    uri = f"http://127.0.0.1:{port}"
    results = write_study(tmp_path / "results")
    first = sync(results, "lost", uri)
    assert first.runs_created == 5
    before = requests_served(log)
    again = sync(results, "lost", uri)  # nothing new: the study's run, one search of its 5 runs, its saved views
    assert (again.runs_created, again.steps_logged, again.evals_logged) == (0, 0, 0)
    assert requests_served(log) - before == 1 + 1 + 1  # it was one request per run, then these two
    gone = first.child_run_ids["toy__k1-reward__b0.05__s0"]
    client(uri).delete_run(gone)
    rebuilt = sync(results, "lost", uri)
    assert rebuilt.runs_created == 1 and rebuilt.steps_logged == 4 and rebuilt.evals_logged == 1
    children, _ = child_runs(uri, "lost")
    assert len(children) == 5 and gone not in {r.info.run_id for r in children}
    run = next(r for r in children if r.data.tags["klstudy.run_id"] == "toy__k1-reward__b0.05__s0")
    assert run.data.params["objective.placement"] == "reward" and run.info.status == "FINISHED"
    assert run.data.metrics["eval/all/math500/pass_at_1"] == 0.5


def test_a_point_rerun_from_scratch_replaces_its_child_run(tmp_path):
    """`--config rerun=...` moves a run directory aside (sweep.study.rerun): the next sync deletes the old child run
    (restorable in MLflow) and logs the new run's steps into a new one, so the study keeps one row per point.
    Before, the new directory adopted the old child by its tags, and its first steps were taken as logged."""
    from sweep.tracking import sync_records

    results = write_study(tmp_path / "results")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = sync(results, "rerun", uri)
    name = "toy__k3-loss__b0.05__s0"
    run_dir = results / "runs" / name
    children = sync_records.claimed_children(results, name)
    assert not (run_dir / sync_records.HIDDEN).exists()  # the sync wrote nothing into the run directory
    run_dir.rename(tmp_path / "discarded")
    for key, run_ids in children.items():
        sync_records.retire(sync_records.run_records(results, name, key), run_ids)
    write_run(results, name, "k3", "loss", 0.05, 0, [0.9, 0.9], {"math500": 0.3})  # retrained: 2 steps so far
    again = sync(results, "rerun", uri)
    assert again.runs_created == 1 and again.child_run_ids[name] != first.child_run_ids[name]
    grid_points, _ = child_runs(uri, "rerun")
    assert sorted(r.data.tags["klstudy.run_id"] for r in grid_points) == sorted(first.child_run_ids)
    new = next(r for r in grid_points if r.data.tags["klstudy.run_id"] == name)
    history = client(uri).get_metric_history(new.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.9), (1, 0.9)]
    assert client(uri).get_run(first.child_run_ids[name]).info.lifecycle_stage == "deleted"


def test_an_unreachable_server_is_one_clear_error(tmp_path):
    results = write_study(tmp_path / "results")
    env = dict(os.environ, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    done = subprocess.run([sys.executable, "-m", "sweep", "track", "--results", str(results), "--study", "x",
                           "--uri", f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "does not answer (connection refused): start it, or point tracking.uri" in done.stderr


LIVE_STUDY = {
    "study": "live-uri",
    "results": "results",
    "grid": {"estimators": ["k1"], "placements": ["reward"], "betas": [0.1], "seeds": [0], "baseline": False},
    "run": {"task": {"name": "arithmetic", "options": {"max_operand": 9}}, "rollout": {"max_new_tokens": 4},
            "train": {"steps": 3, "prompts_per_step": 4, "group_size": 4}},
    "data": {"heldout": {"task": "arithmetic", "options": {"max_operand": 9, "seed": 1}, "n": 10}},
    "evaluate": {"suites": ["toy"], "samples": 2, "data": {"arith": "heldout"}},
}
REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = [*test_workflow.SNAKEMAKE, *test_workflow.LOCAL]


def live_study(directory, model, **tracking):
    config = json.loads(json.dumps(LIVE_STUDY)) | {"models": {"toy": {"path": str(model)}}}
    if tracking:
        config["tracking"] = tracking
    path = directory / "study.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def test_the_study_configs_tracking_uri_drives_the_training_jobs_followers(warm_model, tmp_path, served):
    """tracking.uri, not only MLFLOW_TRACKING_URI, starts each training job's follower, and wins over the
    variable (here pointing at a port where nothing listens). The study is opened before training starts.
    Only the training job runs: the run's steps in MLflow are the follower's. The key used to reach the
    track and report jobs only; with it alone, there were no live curves."""
    port, _ = served
    uri = f"http://127.0.0.1:{port}"
    config = live_study(tmp_path, warm_model, uri=uri)
    name = "toy__k1-reward__b0.1__s0"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}")
    done = subprocess.run([*SNAKEMAKE, f"results/.jobs/train/{name}.done", "--directory", str(tmp_path), "--configfile",
                           str(config)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    children, parents = child_runs(uri, "live-uri")
    assert len(parents) == 1 and [r.data.tags["klstudy.run_id"] for r in children] == [name]
    steps = client(uri).get_metric_history(children[0].info.run_id, "reward_mean")
    assert sorted(m.step for m in steps) == [0, 1, 2] and children[0].info.status == "FINISHED"
    started = (tmp_path / "results" / "runs" / name / "config.yaml").stat().st_mtime * 1000
    assert parents[0].info.start_time <= started  # opened before the training job began
    assert "MLflow, the study's runs (live): " + uri in done.stderr


def test_without_tracking_uri_the_variable_starts_followers_and_without_either_none_start(toy_model, tmp_path):
    """The precedence: tracking.uri, else MLFLOW_TRACKING_URI (read in the job, which checks that it has
    it), else no follower (the track job syncs into results/mlflow.db at the end)."""
    config = live_study(tmp_path, toy_model)  # a dry run too checks that the model is there
    base = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    shown = {}
    for label, env in (("variable", base | {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}), ("none", base)):
        dry = subprocess.run([*SNAKEMAKE, "--directory", str(tmp_path), "--configfile", str(config), "-n", "-p"],
                             capture_output=True, text=True, env=env, timeout=300)
        assert dry.returncode == 0, dry.stderr[-3000:]
        shown[label] = dry.stdout + dry.stderr
    assert 'if [ -n "${MLFLOW_TRACKING_URI:-}" ]; then' in shown["variable"]
    assert "--study live-uri --follow results/runs/toy__k1-reward__b0.1__s0" in shown["variable"]
    assert "--follow" not in shown["none"] and "sweep track --results results --study live-uri" in shown["none"]


PASSWORD = "s3cret-Pass-8817"


def test_a_server_with_basic_auth_takes_the_credentials_from_mlflows_variables_and_refuses_others(tmp_path):
    """The recipe of docs/guides/tracking.md: `mlflow server --app-name basic-auth` on 127.0.0.1. With
    MLFLOW_TRACKING_USERNAME/PASSWORD the sync goes through; without, or with a wrong password, one
    error says what to set. The password appears in no output, result file or MLflow param."""
    config = tmp_path / "basic_auth.ini"
    config.write_text(f"[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                      f"database_uri = sqlite:///{tmp_path / 'basic_auth.db'}\nadmin_username = admin\n"
                      f"admin_password = {PASSWORD}\n"
                      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    port = free_port()
    server_env = dict(os.environ, MLFLOW_AUTH_CONFIG_PATH=str(config), MLFLOW_FLASK_SERVER_SECRET_KEY="test-only")
    process = start_server(tmp_path, port, "--app-name", "basic-auth", env=server_env)
    try:
        results = write_study(tmp_path / "results")
        track = [sys.executable, "-m", "sweep", "track", "--results", str(results), "--study", "guarded",
                 "--uri", f"http://127.0.0.1:{port}"]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
        for env in (clean, clean | {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "wrong"}):
            refused = subprocess.run(track, capture_output=True, text=True, env=env, timeout=120)
            assert refused.returncode == 2, refused.stderr[-2000:]
            assert "refused access (UNAUTHENTICATED): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" \
                in refused.stderr and "Traceback" not in refused.stderr
        admin = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": PASSWORD}
        allowed = subprocess.run(track, capture_output=True, text=True, timeout=300, env=clean | admin)
        assert allowed.returncode == 0, allowed.stderr[-2000:]
        assert json.loads(allowed.stdout)["runs_created"] == 5
        assert PASSWORD not in allowed.stdout + allowed.stderr
        assert not [p for p in results.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]
        auth = {"Authorization": "Basic " + base64.b64encode(f"admin:{PASSWORD}".encode()).decode()}
        experiment = rest(port, "experiments/get-by-name?experiment_name=klstudy/guarded", headers=auth)["experiment"]
        runs = rest(port, "runs/search", {"experiment_ids": [experiment["experiment_id"]]}, headers=auth)["runs"]
        assert len(runs) == 6 and PASSWORD not in json.dumps(runs)  # params, tags: no credentials
    finally:
        stop_server(process)


def test_a_server_that_does_not_allow_the_clients_host_name_says_so_and_how_to_allow_it(tmp_path):
    """MLflow 3's server answers 403 to a Host header that is neither localhost nor a private IP (its guard
    against DNS rebinding), as it answers missing credentials; compute nodes reach a login node's server by
    the node's name. 127.0.0.2 is such a host: the sync stops with one line naming it and `--allowed-hosts`,
    not the credentials, and with the recipe's `--allowed-hosts NAME:PORT` it goes through."""
    results = write_study(tmp_path / "results")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    for allowed in (False, True):
        port = free_port()
        host = f"127.0.0.2:{port}"
        extra = ["--allowed-hosts", host] if allowed else []
        (directory := tmp_path / f"allowed-{allowed}").mkdir()
        process = start_server(directory, port, *extra, host="127.0.0.2")
        try:
            done = subprocess.run([sys.executable, "-m", "sweep", "track", "--results", str(results), "--study",
                                   "hosts", "--uri", f"http://{host}"], capture_output=True, text=True, env=clean,
                                  timeout=300)
        finally:
            stop_server(process)
        if allowed:
            assert done.returncode == 0, done.stderr[-2000:]
            assert json.loads(done.stdout)["runs_created"] == 5
        else:
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
            assert (f"the tracking server http://{host} does not allow the host name {host} that this client "
                    f"reaches it by") in done.stderr
            assert f"mlflow server ... --allowed-hosts {host}" in done.stderr
            assert "MLFLOW_TRACKING_USERNAME" not in done.stderr


def test_credentials_written_into_a_uri_are_never_shown():
    from sweep.tracking.experiment import public_uri, runs_page

    assert public_uri("http://admin:pw@example.org:5000/") == "http://example.org:5000/"
    assert public_uri("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    assert "pw" not in runs_page("https://admin:pw@example.org", "3")


def test_tracking_down_during_a_training_run_then_a_sync_loses_nothing(warm_model, tmp_path):
    results = tmp_path / "results"
    run = results / "runs" / "live"
    port = free_port()  # nothing listens here yet: the tracking server is down
    env = dict(os.environ, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="2")
    follower = subprocess.Popen([sys.executable, "-m", "sweep", "track", "--results", str(results), "--study", "live",
                                 "--uri", f"http://127.0.0.1:{port}", "--follow", str(run), "--interval", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    training = subprocess.run([sys.executable, "-m", "trainer", "train", "--out", str(run), f"model.path={warm_model}",
                               "task.options={max_operand: 9}", "rollout.max_new_tokens=4", "train.steps=12",
                               "train.prompts_per_step=4", "train.group_size=4"],
                              capture_output=True, text=True, timeout=600)
    assert training.returncode == 0, training.stderr  # training never depends on tracking
    assert follower.wait(timeout=120) == 0
    assert "tracking sync failed" in follower.stderr.read()
    process = start_server(tmp_path, port)
    try:
        report = sync(results, "live", uri=f"http://127.0.0.1:{port}")
        assert report.steps_logged == 12
        history = client(f"http://127.0.0.1:{port}").get_metric_history(report.child_run_ids["live"], "reward_mean")
        assert sorted(m.step for m in history) == list(range(12))
    finally:
        stop_server(process)


def test_the_tracking_server_away_mid_study_loses_and_repeats_nothing(warm_model, tmp_path):
    """A study with live tracking whose server goes away once its first run has logged steps, and comes back only
    once every run has finished training (issue 61's fault): the jobs go on without it, the followers and the
    track job catch up, and MLflow ends with one child per grid point holding each step once."""
    port = free_port()
    uri, server_dir = f"http://127.0.0.1:{port}", tmp_path / "server"
    server_dir.mkdir()
    server = start_server(server_dir, port)
    config = json.loads(live_study(tmp_path / "study", warm_model, uri=uri).read_text())
    config["grid"] = {**config["grid"], "seeds": [0, 1], "baseline": True}
    config["run"]["train"]["steps"] = 12
    (tmp_path / "study" / "study.yaml").write_text(json.dumps(config))
    runs = [tmp_path / "study" / "results" / "runs" / name for name in
            ("toy__k1-reward__b0.1__s0", "toy__none__s0", "toy__k1-reward__b0.1__s1", "toy__none__s1")]
    log = (tmp_path / "snakemake.log").open("w")
    study = subprocess.Popen([*SNAKEMAKE, "--directory", str(tmp_path / "study"), "--configfile",
                              str(tmp_path / "study" / "study.yaml")], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not any((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2
                       for run in runs):
            assert study.poll() is None and time.monotonic() < deadline, (tmp_path / "snakemake.log").read_text()
            time.sleep(0.2)
        stop_server(server)  # away: the runs train on
        while not all((run / "COMPLETE").exists() for run in runs):
            assert study.poll() is None and time.monotonic() < deadline, (tmp_path / "snakemake.log").read_text()
            time.sleep(0.2)
        away = [len(run.joinpath("metrics.jsonl").read_text().splitlines()) for run in runs]
        server = start_server(server_dir, port)  # back, before the track job
        assert study.wait(timeout=600) == 0, (tmp_path / "snakemake.log").read_text()[-5000:]
    finally:
        if study.poll() is None:
            os.killpg(study.pid, signal.SIGKILL)
        stop_server(server)
    assert away == [12] * 4  # every run finished training while the server was away
    followers = "".join(path.read_text() for path in (tmp_path / "study" / "results" / "logs" / "train").glob(
        "*.track.log"))
    assert "Connection refused" in followers  # the followers met the outage (and retried, or were ended by their job)
    server = start_server(server_dir, port)
    try:
        children, parents = child_runs(uri, "live-uri")
        assert len(parents) == 1 and sorted(r.data.tags["klstudy.run_id"] for r in children) == \
            sorted(run.name for run in runs)
        for child in children:
            steps = [m.step for m in client(uri).get_metric_history(child.info.run_id, "reward_mean")]
            assert sorted(steps) == list(range(12)), (child.data.tags["klstudy.run_id"], steps)  # each step once
            assert child.info.status == "FINISHED" and "eval/toy/arith/pass_at_1" in child.data.metrics
    finally:
        stop_server(server)
