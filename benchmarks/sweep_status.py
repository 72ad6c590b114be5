"""`python -m sweep status` on a synthetic paper-sized results tree: how long a researcher waits for it.

    python benchmarks/sweep_status.py [--config workflow/config/paper.yaml] [--repeat 7] [--keep DIR]

The tree is the study's whole grid (paper.yaml: 333 points) in the states of a study in mid-course,
its files written as the trainer and the evaluation write them: a quarter of the runs finished (a
metrics.jsonl of every step, COMPLETE, every evaluation's metrics.json with what made it), a quarter running (a
lease whose heartbeat is fresh, half of their steps logged), a tenth failed (FAILED), the rest
pending (some with steps logged, most not started). The command then runs --repeat times in a
fresh interpreter, as a person types it; the last line is `status_s=<median>` (what the docs quote).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sweep.study import jobs  # noqa: E402
from sweep.study.evaluations import Expected  # noqa: E402
from sweep.study.grid import load_study  # noqa: E402
from trainer.run_files import COMPLETE, METRICS, record_failure  # noqa: E402

LINE = {"reward_mean": 0.5, "pass_rate": 0.5, "loss": 0.1, "kl_k3": 0.01, "grad_norm": 1.0, "lr": 1e-6,
        "step_time": 10.0, "generated_tokens": 100000, "trained_tokens": 100000}  # about a real line's size


def write_tree(config_file: Path, results: Path) -> tuple[Path, int]:
    """The synthetic results tree and a config file pointing at it; (that file, the number of points)."""
    config = yaml.safe_load(config_file.read_text())
    config["results"] = str(results)
    study = load_study(config)
    expected = Expected(study)  # what each evaluation records (its provenance), as the study's jobs write it
    targets: dict[str, list[jobs.EvalTarget]] = {}
    for target in jobs.evaluations(study):
        targets.setdefault(target.run, []).append(target)
    for number, run in enumerate(study.runs):
        run_dir = results / "runs" / run.run_id
        steps = run.config.get("train", {}).get("steps", 20)
        kind = ("done", "running", "done", "pending", "failed", "done", "running", "pending", "pending",
                "pending")[number % 10]
        logged = steps if kind == "done" else steps // 2 if kind in ("running", "failed") else steps // 4 * (
            number % 2)
        if logged:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / METRICS).write_text("".join(json.dumps({"step": s, **LINE}) + "\n" for s in range(logged)))
            (run_dir / "config.yaml").write_text(yaml.safe_dump(run.config))
        if kind == "done":
            (run_dir / COMPLETE).write_text(json.dumps({"steps": steps, "finished": time.time()}) + "\n")
            for target in targets.get(run.run_id, []):
                out = results / "eval" / target.key
                out.mkdir(parents=True, exist_ok=True)
                (out / "metrics.json").write_text(json.dumps({"tasks": {"math500": {"value": 0.5, "n": 500}},
                                                              "provenance": expected(target)}))
        elif kind == "running":
            (run_dir / "lease.0.json").write_text(json.dumps({"host": "gpu-node-1", "pid": 1000 + number,
                                                              "slurm_job": f"4242_{number}",
                                                              "heartbeat": time.time()}))
        elif kind == "failed":
            record_failure(run_dir, "3 non-finite updates in a row at step 125", logged)
    path = results.parent / "study.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, len(study.runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "workflow" / "config" / "paper.yaml")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--keep", type=Path, help="build the tree here and keep it (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sweep-status-") as tmp:
        root = args.keep or Path(tmp)
        config, points = write_tree(args.config, root / "results")
        command = [sys.executable, "-m", "sweep", "status", "--configfile", str(config)]
        seconds, shown = [], ""
        for _ in range(args.repeat):
            start = time.perf_counter()
            shown = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout
            seconds.append(time.perf_counter() - start)
        print(shown.splitlines()[0])
        print(f"{points} points, {args.repeat} runs of `python -m sweep status`: median "
              f"{statistics.median(seconds):.2f} s, max {max(seconds):.2f} s")
        print(f"status_s={statistics.median(seconds):.2f}")


if __name__ == "__main__":
    main()
