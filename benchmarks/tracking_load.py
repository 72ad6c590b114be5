"""Live tracking under load: a synthetic paper-shaped study against a real `mlflow server` on 127.0.0.1.

    python benchmarks/tracking_load.py [--runs 333] [--steps 250] [--followers 64] [--interval 10] ...

The study is paper.yaml's grid (its first --runs run ids and run configs), its run directories
written as the trainer writes them: config.yaml, metrics.jsonl lines with the keys of a real toy
training step (one is run first to get them), appended and flushed one line at a time, COMPLETE
last, and two evaluated suites each. Phases, each bounded in time:

1. full sync: --runs minus --followers finished runs of --steps steps, one `python -m sweep track`
   (the study's track job): metric rows per second; then the same command again (nothing new).
2. live: --followers more runs start and append a step every --step-every s for --live-s s, each
   with the follower a training job starts (`sweep.tracking.experiment.follow`, one process each, forked
   from this one), syncing every --interval s. An observer asks the server every --poll-s s
   which steps it shows (one runs/search; its requests are not counted): the lag of each line
   from written to shown. The server's requests come from its access log.
3. nothing new: one follower round (a call of `sweep.tracking.experiment.sync` as `follow` makes it) on a
   finished, synced run, --noop-rounds times in one process: seconds and server requests.

The code measured is the `sweep` package on PYTHONPATH (point it at an old checkout to measure
that). The last line is
    follower_lag_s=<max> noop_round_s=<median>
(a line never shown before the end counts with its lag so far, and is reported).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
STUDY = "load"
LIVE = "live-"  # live runs' id prefix: the observer lists them by run name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, workers: int) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    access = root / "server.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
         str(workers), "--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--artifacts-destination",
         str(root / "artifacts")], stdout=access.open("w"), stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return process, uri, access
        except OSError:
            time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    sys.exit("mlflow server did not start")


def requests_logged(access: Path) -> int:
    """Requests the server answered so far (uvicorn's access log: one line each)."""
    return sum(" HTTP/1.1\" " in line for line in access.read_text(errors="replace").splitlines())


def trainer_line(root: Path) -> dict:
    """One metrics line of a real toy training step (the keys the trainer writes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    python = [sys.executable, "-m", "trainer"]
    subprocess.run([*python, "toy-model", "--out", str(root / "toy")], check=True, capture_output=True, env=env)
    subprocess.run([*python, "train", "--out", str(root / "toy-run"), f"model.path={root / 'toy'}", "train.steps=1",
                    "train.prompts_per_step=4", "train.group_size=4", "rollout.max_new_tokens=4"],
                   check=True, capture_output=True, env=env)
    return json.loads((root / "toy-run" / "metrics.jsonl").read_text().splitlines()[0])


def paper_runs(count: int) -> list[tuple[str, dict]]:
    """The first `count` runs of paper.yaml's grid: (run id, the run config the trainer would write)."""
    from sweep.study.grid import load_study
    from trainer import config as run_config
    study = load_study(yaml.safe_load((REPO / "workflow" / "config" / "paper.yaml").read_text()))
    return [(run.run_id, run_config.load(None, run.overrides()).to_dict()) for run in study.runs[:count]]


def step_line(template: dict, step: int, rng: random.Random) -> str:
    values = {k: (v * (0.5 + rng.random()) if isinstance(v, float) else v) for k, v in template.items()}
    values["step"] = values["policy_step"] = step
    values["step_time"] = 30.0 + rng.random()  # a GPU step of the paper study
    return json.dumps(values) + "\n"


def write_run(results: Path, run_id: str, config: dict, template: dict, steps: int, complete: bool,
              seed: int) -> Path:
    run = results / "runs" / run_id
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    rng = random.Random(seed)
    (run / "metrics.jsonl").write_text("".join(step_line(template, s, rng) for s in range(steps)))
    if complete:
        for suite in ("in_domain", "out_of_domain"):
            directory = results / "eval" / run_id / suite
            directory.mkdir(parents=True)
            tasks = {"math500": {"metric": "pass@1", "value": rng.random(), "stderr": 0.01, "n": 500}}
            (directory / "metrics.json").write_text(json.dumps({"tasks": tasks}))
            (directory / "samples.jsonl").write_text(json.dumps({"doc_id": 0, "resps": ["42"]}) + "\n")
        (run / "COMPLETE").write_text(json.dumps({"steps": steps, "finished": time.time()}) + "\n")
    return run


def timed(command: list[str], limit: float) -> tuple[float, bool]:
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return time.monotonic() - start, False
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - start, True


# --- the live phase --------------------------------------------------------------------------------


def follower(results: Path, run_dir: Path, uri: str, interval: float, rounds: Path) -> None:
    """A training job's follower, each of its rounds (a `sync` call) timed into `rounds`."""
    from sweep.tracking import experiment as tracking

    real_sync = tracking.sync

    def timed_sync(*args, **kwargs):
        start = time.monotonic()
        report = real_sync(*args, **kwargs)
        with rounds.open("a") as handle:
            handle.write(json.dumps({"t": time.time(), "s": time.monotonic() - start, "steps": report.steps_logged,
                                     "work": report.runs_created + report.artifacts_logged}) + "\n")
        return report

    tracking.sync = timed_sync
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # MLflow's "View run ..." lines
        tracking.follow(results, STUDY, run_dir, uri, interval)


def search_live(uri: str, experiment_id: str) -> dict[str, int]:
    """run name -> the newest step of reward_mean the server shows, for every live run."""
    shown, token = {}, None
    while True:
        body = {"experiment_ids": [experiment_id], "filter": f"attributes.run_name LIKE '{LIVE}%'",
                "max_results": 1000, **({"page_token": token} if token else {})}
        request = urllib.request.Request(f"{uri}/api/2.0/mlflow/runs/search", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            page = json.loads(response.read())
        for run in page.get("runs", []):
            steps = [m["step"] for m in run["data"].get("metrics", []) if m["key"] == "reward_mean"]
            if steps:
                shown[run["info"]["run_name"]] = max(int(s) for s in steps)
        token = page.get("next_page_token")
        if not token:
            return shown


def experiment_id(uri: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=klstudy/{STUDY}",
                                    timeout=30) as response:
            return json.loads(response.read())["experiment"]["experiment_id"]
    except OSError:
        return None


def live_phase(args, results: Path, runs: list[tuple[str, dict]], template: dict, uri: str, access: Path,
               root: Path) -> dict:
    live = []
    for number, (run_id, config) in enumerate(runs):
        live.append(write_run(results, f"{LIVE}{run_id}", config, template, 0, False, seed=10_000 + number))
    rounds_dir = root / "rounds"
    rounds_dir.mkdir()
    context = multiprocessing.get_context("fork")
    followers = []
    for number, run in enumerate(live):  # jobs start over --stagger-s, as a queue fills
        process = context.Process(target=follower, args=(results, run, uri, args.interval,
                                                         rounds_dir / f"{number}.jsonl"), daemon=True)
        process.start()
        followers.append(process)
        time.sleep(args.stagger_s / len(live))
    requests_before, start = requests_logged(access), time.monotonic()
    written: dict[str, list[float]] = {run.name: [] for run in live}
    stop = threading.Event()

    def append() -> None:
        rngs = {run.name: random.Random(run.name) for run in live}
        due = {run.name: time.monotonic() + random.Random(run.name).random() * args.step_every for run in live}
        while not stop.is_set():
            name = min(due, key=due.get)
            time.sleep(max(0.0, due[name] - time.monotonic()))
            if stop.is_set():
                return
            with (results / "runs" / name / "metrics.jsonl").open("a") as handle:
                handle.write(step_line(template, len(written[name]), rngs[name]))
                handle.flush()
            written[name].append(time.monotonic())
            due[name] += args.step_every

    writer = threading.Thread(target=append, daemon=True)
    writer.start()
    seen: dict[str, int] = {}
    lags: list[float] = []
    observer_requests = 0
    exp = None

    def observe() -> None:
        nonlocal observer_requests, exp
        exp = exp or experiment_id(uri)
        observer_requests += 1
        if exp is None:
            return
        shown = search_live(uri, exp)
        observer_requests += 1
        now = time.monotonic()
        for name, times in written.items():
            newest = min(shown.get(name, -1), len(times) - 1)
            for step in range(seen.get(name, -1) + 1, newest + 1):
                lags.append(now - times[step])
            seen[name] = max(seen.get(name, -1), newest)

    while time.monotonic() - start < args.live_s:
        observe()
        time.sleep(args.poll_s)
    stop.set()
    writer.join()
    live_s = time.monotonic() - start
    requests = requests_logged(access) - requests_before - observer_requests
    for run in live:
        (run / "COMPLETE").write_text(json.dumps({"steps": len(written[run.name])}) + "\n")
    drain_until = time.monotonic() + args.drain_s  # the followers' last rounds
    while time.monotonic() < drain_until and (any(p.is_alive() for p in followers)
                                              or any(seen.get(n, -1) < len(t) - 1 for n, t in written.items())):
        observe()
        time.sleep(args.poll_s)
    stuck = [p for p in followers if p.is_alive()]
    for process in stuck:
        process.kill()
    now = time.monotonic()
    unseen = [now - times[step] for name, times in written.items() for step in range(seen.get(name, -1) + 1,
                                                                                      len(times))]
    rounds = [json.loads(line) for path in rounds_dir.iterdir() for line in path.read_text().splitlines()]
    quiet = [r["s"] for r in rounds if not r["steps"] and not r["work"]]
    return {"followers": len(live), "lines": sum(map(len, written.values())), "live_s": live_s,
            "requests_per_s": requests / live_s, "lags": lags, "unseen": unseen, "stuck": len(stuck),
            "rounds": [r["s"] for r in rounds], "quiet_rounds": quiet}


def noop_rounds(results: Path, runs: list[Path], uri: str, access: Path) -> tuple[list[float], float]:
    """One follower round on a finished, synced run, as `follow` makes it: seconds each, requests each."""
    from sweep.tracking import experiment as tracking

    own_runs = "runs" in inspect.signature(tracking.sync).parameters
    seconds, before = [], requests_logged(access)
    for run in runs:
        start = time.monotonic()
        if own_runs:
            tracking.sync(results, STUDY, uri, runs=[run])
        else:
            tracking.sync(results, STUDY, uri)
        seconds.append(time.monotonic() - start)
    return seconds, (requests_logged(access) - before) / len(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=333, help="runs of the study (paper.yaml has 333)")
    parser.add_argument("--steps", type=int, default=250, help="steps of each finished run (paper.yaml: 250)")
    parser.add_argument("--followers", type=int, default=64, help="live runs, each with its follower")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between a follower's rounds")
    parser.add_argument("--step-every", type=float, default=5.0, help="seconds between a live run's steps")
    parser.add_argument("--live-s", type=float, default=120.0, help="how long the live runs append steps")
    parser.add_argument("--stagger-s", type=float, default=10.0, help="the followers start over this long")
    parser.add_argument("--drain-s", type=float, default=None, help="after the live phase, how long to wait for "
                        "the last lines and followers (default: 2 intervals + 30 s)")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between the observer's looks")
    parser.add_argument("--noop-rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2, help="the mlflow server's worker processes")
    parser.add_argument("--sync-limit-s", type=float, default=3600.0, help="bound on each full sync")
    args = parser.parse_args()
    args.drain_s = args.drain_s if args.drain_s is not None else 2 * args.interval + 30
    import mlflow.tracking  # noqa: F401 - imported once, before the followers fork

    from sweep.tracking import experiment as tracking

    print(f"code: {Path(tracking.__file__).resolve().parent.parent}; {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tracking-load-") as tmp:
        root = Path(tmp)
        template = trainer_line(root)
        metrics_per_step = sum(isinstance(v, (int, float)) for k, v in template.items() if k != "step")
        grid = paper_runs(args.runs)
        finished, live = grid[: args.runs - args.followers], grid[args.runs - args.followers:]
        results = root / "results"
        for number, (run_id, config) in enumerate(finished):
            write_run(results, run_id, config, template, args.steps, True, seed=number)
        server, uri, access = start_server(root, args.workers)
        try:
            track = [sys.executable, "-m", "sweep", "track", "--results", str(results), "--study", STUDY, "--uri", uri]
            rows = len(finished) * args.steps * metrics_per_step
            before = requests_logged(access)
            full_s, finished_in_time = timed(track, args.sync_limit_s)
            full_requests = requests_logged(access) - before
            print(f"full sync: {len(finished)} runs x {args.steps} steps x {metrics_per_step} metrics = {rows} rows "
                  f"in {full_s:.1f} s: {rows / full_s:.0f} rows/s, {full_requests} requests"
                  + ("" if finished_in_time else " (STOPPED at --sync-limit-s; rows/s is an upper bound)"), flush=True)
            paper_rows = 333 * 250 * metrics_per_step
            print(f"  paper study (333 x 250 x {metrics_per_step} = {paper_rows} rows) at that rate: "
                  f"{paper_rows / (rows / full_s) / 60:.1f} min", flush=True)
            again_s, _ = timed(track, args.sync_limit_s)
            print(f"full sync again, nothing new: {again_s:.1f} s", flush=True)
            outcome = live_phase(args, results, live, template, uri, access, root)
            lags = outcome["lags"] + outcome["unseen"]
            print(f"live: {outcome['followers']} followers every {args.interval:g} s, {outcome['lines']} lines in "
                  f"{outcome['live_s']:.0f} s; server {outcome['requests_per_s']:.1f} requests/s (the observer's "
                  f"excluded)", flush=True)
            print(f"  lag written -> shown: median {statistics.median(lags):.1f} s, max {max(lags):.1f} s over "
                  f"{len(lags)} lines; {len(outcome['unseen'])} never shown before the end; "
                  f"{outcome['stuck']} followers still running at the end (killed)", flush=True)
            if outcome["rounds"]:
                quiet = outcome["quiet_rounds"]
                print(f"  follower rounds: {len(outcome['rounds'])}, median "
                      f"{statistics.median(outcome['rounds']):.2f} s, max {max(outcome['rounds']):.1f} s; "
                      f"with nothing new: {len(quiet)}"
                      + (f", median {statistics.median(quiet):.3f} s" if quiet else ""), flush=True)
            synced = [results / "runs" / run_id for run_id, _ in finished[: args.noop_rounds]]
            seconds, per_round = noop_rounds(results, synced, uri, access)
            print(f"nothing-new round of one job: median {statistics.median(seconds):.3f} s over {len(seconds)}, "
                  f"{per_round:.1f} server requests each", flush=True)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    print(f"follower_lag_s={max(lags):.1f} noop_round_s={statistics.median(seconds):.3f}")


if __name__ == "__main__":
    main()
