"""The report's figures: training curves, accuracy against beta and over training, and reward
against KL to the reference beside the analytic optimum's frontier."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from sweep.report import NO_BETA, Row, sort_key
from sweep.runs import RunRecord
from trainer.optimum import frontier, optimal_kl, optimal_reward, optimal_value, reference_value

CURVES = ("reward_mean", "kl_k3", "entropy", "response_length")
ESTIMATOR_COLORS = {"k1": "tab:blue", "k2": "tab:orange", "k3": "tab:green"}
ESTIMATOR_MARKERS = {"k1": "o", "k2": "s", "k3": "^"}  # reward-against-KL figure: marker = estimator,
PLACEMENT_FILLS = {"reward": "full", "loss": "none", "reward+loss": "left"}  # fill = placement, colour = beta


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, title: str, path: Path, tight: bool = True) -> Path:
    """Title, lay out, save and close a figure."""
    plt = _pyplot()
    fig.suptitle(title)
    if tight:
        fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_curves_figure(record: RunRecord, path: Path) -> Path:
    """One run's reward, KL, entropy and length over steps (logged with its MLflow run). Laid out by
    hand: a study's sync draws one per run, and tight_layout would double the time of each."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3), dpi=80)
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.17, top=0.8, wspace=0.25)
    steps = [m["step"] for m in record.metrics]
    for ax, key in zip(axes, CURVES, strict=True):
        ax.plot(steps, [m.get(key, float("nan")) for m in record.metrics])
        ax.set_title(key)
        ax.set_xlabel("step")
    return _finish(fig, record.run_id, path, tight=False)


def _mean_curve(runs: list[RunRecord], key: str) -> tuple[list[float], list[float], list[float]]:
    """Mean, min and max over runs of a metric, step by step (over the steps every run has)."""
    length = min(len(r.metrics) for r in runs)
    series = [[float(r.metrics[i].get(key, float("nan"))) for r in runs] for i in range(length)]
    return [statistics.fmean(s) for s in series], [min(s) for s in series], [max(s) for s in series]


def curves_figures(records: list[RunRecord], out: Path) -> list[Path]:
    """Per model and beta, small multiples: a row per metric, a column per placement; in each panel the
    estimators (mean over seeds, min-max shaded) and the no-KL baseline (dotted)."""
    plt = _pyplot()
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        c = record.coords
        if c["placement"] != "none" and record.metrics:
            groups.setdefault((c["model"], f"{c['beta']:g}"), []).append(record)
    paths = []
    for (model, beta), members in sorted(groups.items()):
        baseline = [r for r in records if r.coords["placement"] == "none" and r.coords["model"] == model
                    and r.metrics]
        placements = list(dict.fromkeys(r.coords["placement"] for r in sorted(members, key=sort_key)))
        fig, axes = plt.subplots(len(CURVES), len(placements), figsize=(4.2 * len(placements), 2.6 * len(CURVES)),
                                 dpi=110, squeeze=False, sharex=True, sharey="row")
        for column, placement in enumerate(placements):
            by_estimator: dict[str, list[RunRecord]] = {}
            for record in sorted(members, key=sort_key):
                if record.coords["placement"] == placement:
                    by_estimator.setdefault(record.coords["estimator"], []).append(record)
            for row, key in enumerate(CURVES):
                ax = axes[row][column]
                for estimator, runs in by_estimator.items():
                    mean, low, high = _mean_curve(runs, key)
                    color = ESTIMATOR_COLORS.get(estimator)
                    ax.plot(range(len(mean)), mean, color=color, label=estimator)
                    ax.fill_between(range(len(mean)), low, high, color=color, alpha=0.15)
                if baseline:
                    mean, _, _ = _mean_curve(baseline, key)
                    ax.plot(range(len(mean)), mean, color="gray", linestyle=":", label="no KL")
                ax.grid(alpha=0.3)
                if row == 0:
                    ax.set_title(f"KL in the {placement}")
                if column == 0:
                    ax.set_ylabel(key)
                if row == len(CURVES) - 1:
                    ax.set_xlabel("step")
        axes[0][0].legend(fontsize=7)
        paths.append(_finish(fig, f"{model}, beta = {beta}: mean over seeds, min-max shaded",
                             out / f"curves_{model}_beta{beta}.png"))
    return paths


def accuracy_vs_beta_figures(rows: list[Row], tasks: list[str], out: Path) -> list[Path]:
    """Per model: pass@1 against beta for every configuration, the no-KL baseline dashed."""
    plt = _pyplot()
    paths = []
    for model in sorted({r.model for r in rows}):
        mine = [r for r in rows if r.model == model]
        if not tasks or not any(r.beta != NO_BETA for r in mine):
            continue
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), dpi=110, squeeze=False)
        for ax, task in zip(axes[0], tasks, strict=True):
            for label in dict.fromkeys(r.configuration for r in mine if r.beta != NO_BETA):
                points = sorted((float(r.beta), r.cells[task]) for r in mine
                                if r.configuration == label and r.beta != NO_BETA and task in r.cells)
                if points:
                    ax.errorbar([b for b, _ in points], [c.mean for _, c in points],
                                yerr=[c.std for _, c in points], marker="o", capsize=3, label=label)
            for r in mine:
                if r.beta == NO_BETA and task in r.cells:
                    ax.axhline(r.cells[task].mean, linestyle="--", color="gray", label="no KL")
            ax.set_xscale("log")
            ax.set_xlabel("beta")
            ax.set_title(f"{task} pass@1")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        paths.append(_finish(fig, f"{model}: accuracy against beta", out / f"accuracy_vs_beta_{model}.png"))
    return paths


def _accuracy_by_step(record: RunRecord, task: str) -> dict[int, float]:
    """pass@1 of `task` at every evaluated step of a run (kept checkpoints, then the final model)."""
    points = {step: suites[suite]["tasks"][task]["value"] for step, suites in record.checkpoint_evals.items()
              for suite in suites if task in suites[suite].get("tasks", {})}
    points.update({len(record.metrics): value for name, value in record.scores().items() if name == task})
    return points


def accuracy_over_training_figures(records: list[RunRecord], tasks: list[str], out: Path) -> list[Path]:
    """Per model and beta, when checkpoints were evaluated (evaluate.every): pass@1 against the training
    step for every configuration (mean over seeds), the no-KL baseline dotted."""
    plt = _pyplot()
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        if record.checkpoint_evals:
            c = record.coords
            groups.setdefault((c["model"], "-" if c["beta"] is None else f"{c['beta']:g}"), []).append(record)
    paths = []
    for (model, beta), members in sorted(groups.items()):
        if beta == "-":
            continue
        members = members + groups.get((model, "-"), [])
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), dpi=110, squeeze=False)
        for ax, task in zip(axes[0], tasks, strict=True):
            by_label: dict[str, list[dict[int, float]]] = {}
            for record in sorted(members, key=sort_key):
                by_label.setdefault(record.label, []).append(_accuracy_by_step(record, task))
            for label, runs in by_label.items():
                steps = sorted(set.intersection(*(set(r) for r in runs)))
                ax.plot(steps, [statistics.fmean(r[s] for r in runs) for s in steps], marker="o", label=label,
                        linestyle=":" if label == "no KL" else "-")
            ax.set_title(f"{task} pass@1")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        paths.append(_finish(fig, f"{model}, beta = {beta}: accuracy over training (mean over seeds)",
                             out / f"accuracy_vs_step_{model}_beta{beta}.png"))
    return paths


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def reward_vs_kl_figures(records: list[RunRecord], out: Path) -> list[Path]:
    """Per model: each configuration's final reward against its KL(pi || pi_ref) on the held-out prompts
    (mean over seeds, bars: std), a colour per beta; the frontier of the optima pi*_beta of all betas
    (the most reward for a KL), and for each study beta the line of constant objective J = J* that
    touches it at pi*_beta: a run's vertical distance below its beta's line, times 1, is its gap."""
    plt = _pyplot()
    paths = []
    for model in sorted({r.coords["model"] for r in records}):
        mine = [r for r in records if r.coords["model"] == model and r.measured(None) is not None]
        reference = next((r.objective_reference for r in mine if r.objective_reference), None)
        if not mine or reference is None:
            continue
        histograms = reference["histograms"]
        betas = sorted({float(r.coords["beta"]) for r in mine if r.coords["beta"] is not None})
        colors = {b: plt.cm.viridis(i / max(1, len(betas) - 1) * 0.85) for i, b in enumerate(betas)}
        fig, ax = plt.subplots(figsize=(7.5, 5.5), dpi=110)
        curve = frontier(histograms, np.geomspace(0.02, 20, 80)[::-1])
        ax.plot([k for _, k, _ in curve], [r for _, _, r in curve], color="black", lw=1, label="optimum's frontier")
        ax.plot([0], [statistics.fmean(reference_value(h) for h in histograms)],
                marker="s", color="black", linestyle="none", label="reference")
        groups: dict[tuple, list[dict[str, float]]] = {}
        for record in sorted(mine, key=sort_key):
            groups.setdefault((record.coords["beta"], record.label), []).append(record.measured(None))
        right = max(max(m["kl"] for m in ms) for ms in groups.values())
        for beta in betas:
            star_kl = statistics.fmean(optimal_kl(h, beta) for h in histograms)
            star_value = statistics.fmean(optimal_value(h, beta) for h in histograms)
            right = max(right, star_kl)
            xs = np.linspace(0, right * 1.1, 2)
            ax.plot(xs, star_value + beta * xs, color=colors[beta], linestyle="--", lw=0.8)
            ax.plot([star_kl], [statistics.fmean(optimal_reward(h, beta) for h in histograms)], marker="*",
                    markersize=13, color=colors[beta], linestyle="none", label=f"pi* at beta {beta:g}; J = J* dashed")
        for (beta, label), measured in groups.items():
            kls, rewards = [m["kl"] for m in measured], [m["reward"] for m in measured]
            color = "gray" if beta is None else colors[float(beta)]
            estimator, _, placement = label.partition("-")
            ax.errorbar(statistics.fmean(kls), statistics.fmean(rewards), xerr=_spread(kls), yerr=_spread(rewards),
                        marker=ESTIMATOR_MARKERS.get(estimator, "X"), fillstyle=PLACEMENT_FILLS.get(placement, "full"),
                        markersize=7, color=color, capsize=2, linestyle="none", elinewidth=0.7)
        for estimator, marker in ESTIMATOR_MARKERS.items():  # the key to the markers, in black
            ax.plot([], [], marker=marker, color="black", linestyle="none", label=estimator)
        for placement, fill in PLACEMENT_FILLS.items():
            ax.plot([], [], marker="o", fillstyle=fill, color="black", linestyle="none", label=f"KL in the {placement}")
        ax.plot([], [], marker="X", color="gray", linestyle="none", label="no KL")
        heights = [r for _, _, r in curve] + [statistics.fmean(m["reward"] for m in ms) for ms in groups.values()]
        ax.set_xlim(left=-0.02 * right, right=right * 1.15)
        ax.set_ylim(min(heights) - 0.05, max(heights) + 0.05)  # the J = J* lines run on out of view
        ax.set_xlabel("KL(pi || pi_ref) of whole completions, held-out prompts")
        ax.set_ylabel("mean reward, held-out prompts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right", ncol=2)
        paths.append(_finish(fig, f"{model}: reward against KL to the reference (final models, mean ± std over seeds)",
                             out / f"reward_vs_kl_{model}.png"))
    return paths
