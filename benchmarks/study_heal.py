"""What a study redoes after a hard kill and after a seed is added: this code against another checkout's.

    python benchmarks/study_heal.py --baseline OLD_CHECKOUT [--config workflow/config/toy_quick.yaml]

For each code (this repository, then the baseline's Snakefile and packages on PYTHONPATH), in a fresh
directory, through profiles/local:

1. the study runs until some of its runs have finished and another is mid-way, then Snakemake's
   process group is SIGKILLed, and the same command runs to the end: how many files of the runs that
   had finished were rewritten (bytes or mtime), and how many of those runs were trained again;
2. a seed is added (`grid.seeds` + [max + 1]): how many train and evaluate jobs the dry run plans, and
   the CPU-seconds (user + system, every child) of the command that then runs.

The last line is `rewritten=<files> reopened=<runs> planned=<jobs> cpu_s=<s>` for this code, then the
same for the baseline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def snapshot(runs: list[Path]) -> dict[str, tuple[str, int]]:
    """Every file of these run directories (MLflow's sync records apart): digest and mtime."""
    return {str(path): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
            for run in runs for path in run.rglob("*") if path.is_file() and ".mlflow" not in path.parts}


def run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """A Snakemake command that must succeed; if it does not, its own words end the benchmark."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def measure(code: Path, config: dict, directory: Path) -> dict[str, float]:
    snakemake = [sys.executable, "-m", "snakemake", "--snakefile", str(code / "Snakefile"), "--profile",
                 str(code / "profiles" / "local"), "--cores", "2", "--directory", str(directory)]
    # Run in the study's directory: `python -m` puts the working directory first on sys.path, and from
    # this checkout it would shadow the baseline's packages.
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    study = directory / "study.yaml"
    study.write_text(yaml.safe_dump(config))
    results = directory / config["results"]
    runs = results / "runs"
    log = (directory / "killed.log").open("w")
    process = subprocess.Popen([*snakemake, "--configfile", str(study)], stdout=log, stderr=subprocess.STDOUT,
                               env=env, start_new_session=True, cwd=directory)
    while True:  # some runs finished, another has a checkpoint: kill everything
        finished = [r for r in runs.glob("*") if (r / "COMPLETE").exists()]
        midway = [r for r in runs.glob("*") if (r / "checkpoints").is_dir() and not (r / "COMPLETE").exists()]
        if finished and midway:
            break
        if process.poll() is not None:
            sys.exit(f"the study ended before it could be killed: {(directory / 'killed.log').read_text()[-2000:]}")
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = snapshot(finished)
    attempts = {r: (r / "metrics.jsonl").stat().st_mtime_ns for r in finished}
    run([*snakemake, "--configfile", str(study)], env, directory)
    after = snapshot(finished)
    rewritten = sum(after.get(path) != seen for path, seen in before.items())
    reopened = sum((r / "metrics.jsonl").stat().st_mtime_ns != mtime for r, mtime in attempts.items())

    config["grid"]["seeds"] = [*config["grid"]["seeds"], max(config["grid"]["seeds"]) + 1]
    study.write_text(yaml.safe_dump(config))
    dry = run([*snakemake, "--configfile", str(study), "-n", "--quiet", "rules"], env, directory)
    counts = {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", dry.stdout, re.M)}
    planned = sum(n for rule, n in counts.items() if rule.startswith(("train", "evaluate")))
    start = os.times()
    run([*snakemake, "--configfile", str(study)], env, directory)
    cpu = sum(os.times()[2:4]) - sum(start[2:4])
    return {"finished_at_kill": len(finished), "rewritten": rewritten, "reopened": reopened, "planned": planned,
            "cpu_s": round(cpu, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the code to compare with")
    parser.add_argument("--config", type=Path, default=REPO / "workflow" / "config" / "toy_quick.yaml")
    parser.add_argument("--only", choices=("this", "baseline"), help="measure one of the two codes")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    lines = []
    for name, code in (("this", REPO), ("baseline", args.baseline.resolve())):
        if args.only not in (None, name):
            continue
        with tempfile.TemporaryDirectory(prefix=f"study-heal-{name}-") as tmp:
            found = measure(code, json.loads(json.dumps(config)), Path(tmp))
        print(f"{name}: {json.dumps(found)}", flush=True)
        lines.append(" ".join(f"{key}={found[key]}" for key in ("rewritten", "reopened", "planned", "cpu_s")))
    print("  |  ".join(lines))


if __name__ == "__main__":
    main()
