"""The local SLURM cluster at scale: benchmarks/slurm_scale.yaml (157 jobs, the toy model, 2 steps a run,
no bundles) through profiles/slurm, once, as a user runs it. Needs `profiles/slurm/local-cluster.sh up`.

    python benchmarks/slurm_scale.py [--timeout 3600]

sbatch and sacct are wrapped (a directory first on PATH whose scripts log each call, then run the real
command), so the run reports how many sbatch calls submitted the jobs (job arrays), how many sacct calls
each status round made, and, from SLURM's accounting, the time from the first submission to the last
job's end. The last line is
    jobs=<n> sbatch_calls=<n> sacct_per_round=<max> first_submit_to_last_end_s=<s>
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STUDY = REPO / "benchmarks" / "slurm_scale.yaml"
WRAPPER = """#!/bin/sh
echo "$(date +%s.%N) $*" >> {log}
exec {real} "$@"
"""


def wrap(bin_dir: Path, command: str, log: Path) -> None:
    real = subprocess.run(["which", command], capture_output=True, text=True, check=True).stdout.strip()
    path = bin_dir / command
    path.write_text(WRAPPER.format(log=log, real=real))
    path.chmod(0o755)


def calls(log: Path) -> list[tuple[float, str]]:
    if not log.exists():
        return []
    return [(float(line.split(" ", 1)[0]), line.split(" ", 1)[1] if " " in line else "")
            for line in log.read_text().splitlines()]


def rounds(times: list[float], gap: float = 2.0) -> list[int]:
    """Calls per status round: calls less than `gap` seconds apart belong to one round."""
    counts: list[int] = []
    last = None
    for t in sorted(times):
        if last is None or t - last > gap:
            counts.append(0)
        counts[-1] += 1
        last = t
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="slurm-scale-") as tmp:
        root = Path(tmp)
        bin_dir = root / "bin"
        bin_dir.mkdir()
        logs = {command: root / f"{command}.calls" for command in ("sbatch", "sacct", "squeue")}
        for command, log in logs.items():
            wrap(bin_dir, command, log)
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
        start = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
                                   "--profile", str(REPO / "profiles" / "slurm"), "--directory", str(root / "study"),
                                   "--configfile", str(STUDY)], capture_output=True, text=True, env=env,
                                  timeout=args.timeout)
            stderr, returncode = done.stderr, done.returncode
        except subprocess.TimeoutExpired as error:
            stderr, returncode = (error.stderr or b"").decode(errors="replace"), "timeout"
            subprocess.run(["scancel", "--me"], check=False)
        wall = time.monotonic() - start
        kept = Path(tempfile.gettempdir()) / "slurm_scale.snakemake.log"
        kept.write_text(stderr)  # for reading what broke
        jobs = len(re.findall(r"^Finished jobid", stderr, re.M))
        failed = re.findall(r"SLURM job (\S+) ended (\S+)", stderr)
        sbatch = calls(logs["sbatch"])
        sacct = calls(logs["sacct"])
        folder = next((root / "study" / ".snakemake" / "submitit").iterdir())
        ids = sorted({p.name.split("_")[0] for p in folder.glob("*_submission.sh")})
        accounting = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,Submit,End,State", "-j", ",".join(ids)],
                                    capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [line.split("|") for line in accounting if line]
    submits = [datetime.fromisoformat(r[1]) for r in rows if r[1] != "Unknown"]
    ends = [datetime.fromisoformat(r[2]) for r in rows if r[2] != "Unknown"]
    arrays = Counter(r[0].split("_")[0] for r in rows)
    per_round = rounds([t for t, _ in sacct])
    span = (max(ends) - min(submits)).total_seconds()
    print(f"snakemake: exit {returncode}, {wall:.0f} s, {jobs} jobs finished; SLURM states: "
          f"{dict(Counter(r[3].split()[0] for r in rows))}")
    print(f"submission: {len(sbatch)} sbatch calls for {len(rows)} SLURM jobs; array sizes "
          f"{sorted(arrays.values(), reverse=True)}")
    print(f"status: {len(sacct)} sacct calls in {len(per_round)} rounds, per round max {max(per_round, default=0)}, "
          f"median {sorted(per_round)[len(per_round) // 2] if per_round else 0}; {len(calls(logs['squeue']))} squeue")
    print(f"first submission to last job done: {span:.0f} s")
    if failed:
        print(f"failed: {failed}")
    print(f"Snakemake's log: {kept}")
    print(f"jobs={jobs} sbatch_calls={len(sbatch)} sacct_per_round={max(per_round, default=0)} "
          f"first_submit_to_last_end_s={span:.0f}")


if __name__ == "__main__":
    main()
