"""The study's track job with nothing new to sync: this code against another checkout's, side by side.

    python benchmarks/track_noop.py --baseline OLD_CHECKOUT [--runs 333] [--steps 20] [--rounds 5]

A paper-shaped study of --runs finished runs (paper.yaml's grid, written as in
benchmarks/tracking_load.py) is synced once into a real `mlflow server` on 127.0.0.1. Then `python -m
sweep track` runs again, nothing being new, --rounds times with this repository's `sweep` and
--rounds times with the baseline's (a checkout of an older commit, put first on PYTHONPATH), in
turn: the seconds each takes and the server requests it makes (the server's access log). The
last line is `noop_s=<median> baseline_noop_s=<median> ratio=<baseline / this>`.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tracking_load import REPO, paper_runs, requests_logged, start_server, trainer_line, write_run  # noqa: E402


def track(code: Path, results: Path, uri: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(code))
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "sweep", "track", "--results", str(results), "--study", "noop", "--uri", uri],
                   check=True, capture_output=True, env=env, cwd=code)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the code to compare with")
    parser.add_argument("--runs", type=int, default=333)
    parser.add_argument("--steps", type=int, default=20, help="steps of each run (the first sync's size only)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="track-noop-") as tmp:
        root = Path(tmp)
        template = trainer_line(root)
        results = root / "results"
        for number, (run_id, config) in enumerate(paper_runs(args.runs)):
            write_run(results, run_id, config, template, args.steps, True, seed=number)
        server, uri, access = start_server(root, workers=2)
        try:
            first = track(REPO, results, uri)
            print(f"first sync of {args.runs} runs x {args.steps} steps: {first:.1f} s", flush=True)
            seconds: dict[str, list[float]] = {"this": [], "baseline": []}
            requests: dict[str, list[int]] = {"this": [], "baseline": []}
            for _ in range(args.rounds):
                for name, code in (("this", REPO), ("baseline", args.baseline.resolve())):
                    before = requests_logged(access)
                    seconds[name].append(track(code, results, uri))
                    requests[name].append(requests_logged(access) - before)
            for name in seconds:
                print(f"{name}: nothing new, median {statistics.median(seconds[name]):.2f} s "
                      f"(min {min(seconds[name]):.2f}, max {max(seconds[name]):.2f}), "
                      f"{statistics.median(requests[name]):.0f} server requests", flush=True)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    this, base = statistics.median(seconds["this"]), statistics.median(seconds["baseline"])
    print(f"noop_s={this:.2f} baseline_noop_s={base:.2f} ratio={base / this:.1f}")


if __name__ == "__main__":
    main()
