"""What SLURM through the submitit executor costs, against the local profile, on one small study.

Runs benchmarks/slurm_study.yaml (10 jobs) once with profiles/local and once with profiles/slurm
(status checks every second) in fresh directories, then reads SLURM's accounting of the submitted
jobs. Needs a cluster: profiles/slurm/local-cluster.sh up. The last line is
    overhead_per_job_s=<(slurm - local wall time) / jobs> submit_to_start_s=<median over jobs>

    python benchmarks/slurm_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STUDY = REPO / "benchmarks" / "slurm_study.yaml"
PROFILES = {
    "local": ["--profile", str(REPO / "profiles" / "local"), "--cores", "2"],
    "slurm": ["--profile", str(REPO / "profiles" / "slurm"), "--seconds-between-status-checks", "1",
              "--max-status-checks-per-second", "10"],
}


def run(profile: str, directory: Path) -> tuple[float, int]:
    """Wall time of the whole study and its number of jobs."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
                             *PROFILES[profile], "--directory", str(directory), "--configfile", str(STUDY)],
                            capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        sys.exit(f"the {profile} run failed:\n{result.stderr[-3000:]}")
    return elapsed, result.stderr.count("Finished jobid")


def submit_to_start(directory: Path) -> list[float]:
    """Seconds from sbatch to start for every SLURM job of the run (sacct's 1 s resolution)."""
    folder = next((directory / ".snakemake" / "submitit").iterdir())
    ids = sorted({p.name.split("_")[0] for p in folder.glob("*_submission.sh")}
                 | {p.name.split("_")[0] for p in folder.glob("*_log.out")})
    out = subprocess.run(["sacct", "-n", "-P", "-o", "JobID,Submit,Start", "-j", ",".join(ids)],
                         capture_output=True, text=True, check=True).stdout
    delays = []
    for line in out.splitlines():
        job, submit, begin = line.split("|")
        if "." in job or "Unknown" in (submit, begin):
            continue
        delays.append((datetime.fromisoformat(begin) - datetime.fromisoformat(submit)).total_seconds())
    return delays


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args()  # no options: --help says what it measures
    with tempfile.TemporaryDirectory() as tmp:
        local_s, jobs = run("local", Path(tmp) / "local")
        slurm_s, slurm_jobs = run("slurm", Path(tmp) / "slurm")
        delays = submit_to_start(Path(tmp) / "slurm")
    print(f"local: {local_s:.1f} s for {jobs} jobs; slurm: {slurm_s:.1f} s for {slurm_jobs} jobs")
    print(f"submit to start over {len(delays)} SLURM jobs (arrays count per task): "
          f"median {statistics.median(delays):.1f} s, max {max(delays):.1f} s")
    print(f"overhead_per_job_s={(slurm_s - local_s) / jobs:.2f} submit_to_start_s={statistics.median(delays):.1f}")


if __name__ == "__main__":
    main()
