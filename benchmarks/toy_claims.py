"""The toy study's claims, each with its effect size and a test over seeds, from a finished results directory.

    python benchmarks/toy_claims.py [--results results]

The README and docs/results/toy.md state only what holds here at 10 seeds on both kinds of CPU measured
(`make study` grown by `grid: {seeds: [0, ..., 9]}`; docs/results/toy.md, "What holds at ten seeds, on two
kinds of CPU"). For each claim:
the two means, their difference, a paired t-test over the seeds both have (two-sided, as the report's
stars), Cohen's d_z (the mean paired difference over its standard deviation: how many seed-to-seed
spreads the effect is) and a Wilcoxon signed-rank test (no assumption of normal differences). A claim
against the reference model (one number: it is not trained) is a one-sample test of the runs against it.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sweep.report.table import summarize  # noqa: E402
from sweep.runs import load_runs  # noqa: E402

# (what is claimed, the configuration, the metric, what it is compared with: a configuration or `reference`,
#  the direction claimed: +1 larger, -1 smaller, 0 no difference claimed)
CLAIMS = [
    *[(f"RL learns: {label} ends above the reference's reward", label, "reward", "reference", +1)
      for label in ("k1-reward", "k1-loss", "k1-reward+loss", "k2-reward", "k2-loss", "k2-reward+loss",
                    "k3-reward", "k3-loss", "k3-reward+loss", "no KL")],
    ("k1-loss does not regularize: its KL is above k1-reward's", "k1-loss", "kl_to_ref", "k1-reward", +1),
    ("k1-loss's KL is the no-KL baseline's", "k1-loss", "kl_to_ref", "no KL", 0),
    ("k3-reward is biased: its gap is above k1-reward's", "k3-reward", "objective_gap", "k1-reward", +1),
    ("k3-reward is biased: its reward is below k1-reward's", "k3-reward", "reward", "k1-reward", -1),
    ("k3-reward is biased: its KL is above k1-reward's", "k3-reward", "kl_to_ref", "k1-reward", +1),
    *[(f"{label}, unbiased, ends below the reference's gap", label, "objective_gap", "reference", -1)
      for label in ("k1-reward", "k1-reward+loss", "k3-reward+loss")],
    ("k1-reward's gap is below half the reference's", "k1-reward", "objective_gap", "half the reference", -1),
    ("k3-loss's KL is below k1-reward's", "k3-loss", "kl_to_ref", "k1-reward", -1),
    ("k2-reward's KL is above k1-reward's", "k2-reward", "kl_to_ref", "k1-reward", +1),
]


def by_seed(groups, label: str, metric: str) -> dict[int, float]:
    group = next(g for g in groups if g.label == label)
    return group.cells[metric].by_seed


def test(values: list[float], against: list[float] | float) -> tuple[float, float, float, float]:
    """(mean difference, paired or one-sample t-test's two-sided p, Cohen's d_z, Wilcoxon's two-sided p)."""
    from scipy import stats

    others = against if isinstance(against, list) else [against] * len(values)
    differences = [value - other for value, other in zip(values, others, strict=True)]
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    t = stats.ttest_1samp(differences, 0.0)
    wilcoxon = stats.wilcoxon(differences).pvalue if any(differences) else 1.0
    return mean, float(t.pvalue), mean / sd if sd else math.inf, float(wilcoxon)


def rows(results: Path) -> list[str]:
    groups, _ = summarize(load_runs(results))
    reference = next(g for g in groups if g.label == "reference")
    lines = ["| claim | configuration | vs | seeds | mean | vs mean | difference | paired t p | d_z | Wilcoxon p | "
             "holds |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for claim, label, metric, other, direction in CLAIMS:
        mine = by_seed(groups, label, metric)
        if other in ("reference", "half the reference"):
            value = reference.cells[metric].mean * (0.5 if other.startswith("half") else 1.0)
            seeds, against, other_mean = sorted(mine), value, value
        else:
            theirs = by_seed(groups, other, metric)
            seeds = sorted(mine.keys() & theirs.keys())
            against = [theirs[s] for s in seeds]
            other_mean = statistics.fmean(against)
        values = [mine[s] for s in seeds]
        mean, p, d, w = test(values, against)
        holds = (p < 0.05 and mean * direction > 0) if direction else p >= 0.05
        lines.append(f"| {claim} | {label} | {other} | {len(seeds)} | {statistics.fmean(values):.3f} | "
                     f"{other_mean:.3f} | {mean:+.3f} | {p:.2g} | {d:+.2f} | {w:.2g} | "
                     f"{'yes' if holds else 'no'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "results")
    args = parser.parse_args()
    print("\n".join(rows(args.results)))


if __name__ == "__main__":
    main()
