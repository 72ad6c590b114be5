"""Where a study's wall time goes: per rule, from Snakemake's log, against the training steps' own time.

    python benchmarks/study_time.py [--log .snakemake/log/<newest>.snakemake.log] [--results results]

Job seconds per rule come from the start and finish stamps of every job in the log (1 s resolution).
Training is what the runs' metrics.jsonl count as `step_time` (rollouts, rewards and updates),
plus the objective measurements (`measure_time` of objective.jsonl and of the reference's
sampling in objective_reference.json); everything else in a train
job (interpreter start, imports, model loading, checkpoints) and every other rule is overhead.
With all cores busy, overhead's share of job seconds is its share of the wall time.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.run_files import METRICS, OBJECTIVE, OBJECTIVE_REFERENCE, read_metrics  # noqa: E402

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")


def family(rule: str) -> str:
    """A bundled job's rule (train_<key>, evaluate_<key>: sweep.study.jobs) counts as its family (train, evaluate)."""
    match = re.match(r"^(train|evaluate)_[0-9a-f]{10}$", rule)
    return match.group(1) if match else rule


def job_times(log: Path) -> tuple[dict[str, list[float]], float]:
    """Seconds of every finished job, by rule; and the elapsed time of the whole log."""
    started: dict[str, tuple[str, datetime]] = {}
    seconds: dict[str, list[float]] = {}
    stamp, rule, first, last = None, None, None, None
    for line in log.read_text().splitlines():
        if match := STAMP.match(line):
            stamp = datetime.strptime(match.group(1), "%a %b %d %H:%M:%S %Y")
            first, last = first or stamp, stamp
        elif match := re.match(r"^(?:local)?rule (\w+):$", line):
            rule = (match.group(1), stamp)
        elif (match := re.match(r"^\s+jobid: (\d+)$", line)) and rule is not None:
            started[match.group(1)] = rule
            rule = None
        elif match := re.match(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$", line):
            name, start = started.pop(match.group(1), (match.group(2), stamp))
            seconds.setdefault(family(name), []).append((stamp - start).total_seconds())
    return seconds, (last - first).total_seconds() if first else 0.0


def training_seconds(results: Path) -> tuple[float, float, int]:
    """Sum of step_time and of measure_time over every run, and the number of training steps."""
    steps = measure = 0.0
    count = 0
    for run in sorted((results / "runs").glob("*")):
        lines = read_metrics(run / METRICS)
        steps += sum(float(m.get("step_time", 0)) for m in lines)
        count += len(lines)
        measure += sum(float(m.get("measure_time", 0)) for m in read_metrics(run / OBJECTIVE))
        if (run / OBJECTIVE_REFERENCE).is_file():
            measure += float(json.loads((run / OBJECTIVE_REFERENCE).read_text()).get("measure_time", 0))
    return steps, measure, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, help="a Snakemake log (default: the newest in .snakemake/log)")
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    log = args.log or max(Path(".snakemake/log").glob("*.snakemake.log"), key=lambda p: p.stat().st_mtime)
    by_rule, wall = job_times(log)
    total = sum(sum(v) for v in by_rule.values()) or 1.0
    steps, measure, count = training_seconds(args.results)
    print(f"{log.name}: {wall:.0f} s wall, {total:.0f} job-seconds")
    print("| rule | jobs | job-seconds | share | seconds per job |\n|---|---:|---:|---:|---:|")
    for name, values in sorted(by_rule.items(), key=lambda item: -sum(item[1])):
        if sum(values):
            print(f"| {name} | {len(values)} | {sum(values):.0f} | {sum(values) / total:.0%} | "
                  f"{sum(values) / len(values):.1f} |")
    print(f"\ntraining steps: {count}, {steps:.0f} s of step_time; objective measurements: {measure:.0f} s")
    print(json.dumps({"wall_s": wall, "job_s": total, "train_step_s": steps, "measure_s": measure, "steps": count,
                      "overhead_share": 1 - (steps + measure) / total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
