"""The report's figures: training curves, accuracy and objective gap against every numeric axis
(beta, an async level) and over training, and reward against KL to the reference beside the
analytic optimum's frontier.

A study with extra axes gets a figure per point of them (`_async2`, `_ratio-detached` in the file
name); a run that does not use an axis (no KL loss ratio with the KL in the reward) appears at
every point of it.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from sweep.report import styles
from sweep.report.table import OBJECTIVE_COLUMNS, REFERENCE, Group, extra_axes
from sweep.runs import RunRecord
from sweep.study import axes
from trainer.measure.optimum import frontier, optimal_kl, optimal_reward, optimal_value, reference_value
from trainer.objective import estimators
from trainer.objective.placements import kl_placements

CURVES = ("reward_mean", "kl_k3", "entropy", "response_length", "ess")  # ess: off-policy's early warning
# styles by name (sweep.report.styles); the reward-against-KL figure: marker = estimator, fill = placement,
# colour = beta


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, title: str, path: Path, tight: bool = True, bottom: float = 0.0) -> Path:
    """Title, lay out (above the figure's lower `bottom` fraction, where a legend may sit), save and close."""
    plt = _pyplot()
    fig.suptitle(title)
    if tight:
        fig.tight_layout(rect=(0, bottom, 1, 1))
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


def _extra(records: list[RunRecord]) -> list[str]:
    return list(records[0].extra_axes) if records else []


def _points(runs: list[RunRecord], extra: list[str]) -> list[dict[str, Any]]:
    """The points of the extra axes where some run of `runs` is (a run that does not use an axis, such
    as k1-reward and the KL loss ratio, belongs at each of its values, but makes no point of its own)."""
    values = [list(dict.fromkeys(axes.value_text(r.coords[k]) for r in runs if r.coords[k] is not None)) or [None]
              for k in extra]
    found = []
    for combo in itertools.product(*values):
        point = {k: next((r.coords[k] for r in runs if axes.value_text(r.coords[k]) == v), None)
                 for k, v in zip(extra, combo, strict=True)}
        if any(all(v is None or (r.coords[k] is not None and axes.same_value(r.coords[k], v))
                   for k, v in point.items()) for r in runs):
            found.append(point)
    return found


def _suffix(point: dict[str, Any]) -> str:
    return "".join(f"_{axes.id_part(k, v)}" for k, v in point.items() if v is not None)


def _title(point: dict[str, Any], extra: list[str]) -> str:
    return "".join(f", {axes.header(k, extra)} {axes.value_text(v)}" for k, v in point.items() if v is not None)


def _panels(records: list[RunRecord], keep=lambda record: True) -> list[tuple[str, str, dict, list, list]]:
    """(model, beta, point of the extra axes, its KL runs, its no-KL runs) of every figure drawn per
    model, beta and point, over the records `keep` takes."""
    extra, panels = _extra(records), []
    chosen = [r for r in records if keep(r)]
    for model in sorted({r.coords["model"] for r in chosen}):
        mine = [r for r in chosen if r.coords["model"] == model]
        kl = [r for r in mine if r.coords["placement"] != "none"]
        for beta in sorted({float(r.coords["beta"]) for r in kl}):
            at_beta = [r for r in kl if float(r.coords["beta"]) == beta]
            for point in _points(at_beta, extra):
                members = sorted([r for r in at_beta if axes.covers(r.coords, point)],
                                 key=lambda r: axes.sort_key(r.coords))
                baseline = [r for r in mine if r.coords["placement"] == "none" and axes.covers(r.coords, point)]
                panels.append((model, axes.value_text(beta), point, members, baseline))
    return panels


def curves_figures(records: list[RunRecord], out: Path) -> list[Path]:
    """Per model, beta and point of the extra axes, small multiples: a row per metric, a column per
    placement; in each panel the estimators (mean over seeds, min-max shaded) and the no-KL baseline
    (dotted)."""
    plt, extra, paths = _pyplot(), _extra(records), []
    for model, beta, point, members, baseline in _panels(records, lambda r: bool(r.metrics)):
        placements = list(dict.fromkeys(r.coords["placement"] for r in members))
        fig, grid = plt.subplots(len(CURVES), len(placements), figsize=(4.2 * len(placements), 2.6 * len(CURVES)),
                                 dpi=110, squeeze=False, sharex=True, sharey="row")
        for column, placement in enumerate(placements):
            by_estimator: dict[str, list[RunRecord]] = {}
            for record in members:
                if record.coords["placement"] == placement:
                    by_estimator.setdefault(record.coords["estimator"], []).append(record)
            for row, key in enumerate(CURVES):
                ax = grid[row][column]
                for estimator, runs in by_estimator.items():
                    mean, low, high = _mean_curve(runs, key)
                    color = styles.estimator_color(estimator)
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
        grid[0][0].legend(fontsize=7)
        paths.append(_finish(fig, f"{model}, beta = {beta}{_title(point, extra)}: mean over seeds, min-max shaded",
                             out / f"curves_{model}_beta{beta}{_suffix(point)}.png"))
    return paths


def _numeric_axes(groups: list[Group]) -> list[str]:
    """The axes with at least two numeric values (beta, an async level, a learning rate)."""
    found = []
    for axis in ["beta", *extra_axes(groups)] if groups else []:
        values = {g.coords[axis] for g in groups if not g.reference and g.coords[axis] is not None
                  and not isinstance(g.coords[axis], (list, dict))}
        if len(values) > 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            found.append(axis)
    return found


def axis_figures(groups: list[Group], tasks: list[str], out: Path) -> list[Path]:
    """Per model and numeric axis: each task's pass@1 and the objective gap against the axis, a line per
    configuration (and per value of the other axes), mean over seeds with std bars; the no-KL baseline
    dashed, as a level when it lacks the axis (beta)."""
    plt, paths = _pyplot(), []
    metrics = tasks + [m for m in ("objective_gap",) if any(m in g.cells for g in groups)]
    extra = extra_axes(groups)
    for axis, model in itertools.product(_numeric_axes(groups), sorted({g.coords["model"] for g in groups})):
        mine = [g for g in groups if g.coords["model"] == model and not g.reference]
        others = [k for k in ("beta", *extra) if k != axis
                  and len({axes.value_text(g.coords[k]) for g in mine if g.coords[k] is not None}) > 1]
        if not metrics or not any(g.coords[axis] is not None for g in mine):
            continue
        colors = _series_colors(plt, [_series_name(g, others, extra) for g in mine])  # the same in every panel
        rows = -(-len(colors) // 2)  # the legend's, two series a row below the panels
        legend_height = 0.1 + 0.11 * rows
        height = 3.6 + legend_height
        fig, panels = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), height), dpi=110, squeeze=False)
        for ax, metric in zip(panels[0], metrics, strict=True):
            series: dict[str, list[tuple[float, Any]]] = {}
            for g in mine:
                if metric in g.cells:
                    series.setdefault(_series_name(g, others, extra), []).append((g.coords[axis], g.cells[metric]))
            for name, points in series.items():
                if all(x is None for x, _ in points):  # the baseline without this axis: a level
                    for _, cell in points:
                        ax.axhline(cell.mean, linestyle="--", color="gray", label=name)
                    continue
                points = sorted((float(x), c) for x, c in points if x is not None)
                ax.errorbar([x for x, _ in points], [c.mean for _, c in points], yerr=[c.std for _, c in points],
                            marker="o", capsize=3, label=name, color=colors[name],
                            linestyle="--" if name.startswith("no KL") else "-")
            xs = [g.coords[axis] for g in mine if g.coords[axis] is not None]
            if min(xs) > 0 and max(xs) / min(xs) >= 10:
                ax.set_xscale("log")
            elif all(isinstance(x, int) for x in xs):  # async levels, epochs: whole ticks
                ax.set_xticks(sorted(set(xs)))
            heights = [c.mean for points in series.values() for _, c in points]
            if min(heights) > 0 and max(heights) / min(heights) > 30:  # a collapsed run's gap next to the rest
                ax.set_yscale("log")
            ax.set_xlabel(axes.heading(axis, extra))
            ax.set_title(f"{metric} pass@1" if metric not in OBJECTIVE_COLUMNS
                         else "objective gap J* - J (lower: better)")
            ax.grid(alpha=0.3)
        # Below the panels, from every panel's lines: inside one, a dozen series cover the points.
        shown = {label: handle for ax in panels[0]
                 for handle, label in zip(*ax.get_legend_handles_labels(), strict=True)}
        fig.legend(shown.values(), shown.keys(), loc="lower center", ncol=2, fontsize=6, frameon=False)
        name = axes.heading(axis, extra)
        paths.append(_finish(fig, f"{model}: accuracy and objective gap against {name}",
                             out / f"accuracy_vs_{name}_{model}.png", bottom=legend_height / height))
    return paths


def _series_name(group: Group, others: list[str], extra: list[str]) -> str:
    """A line's name in an axis figure: its configuration and its values of the `others` axes."""
    return group.label + "".join(f", {axes.heading(k, extra)} {axes.value_text(group.coords[k])}"
                                 for k in others if group.coords[k] is not None)


def _series_colors(plt, names: list[str]) -> dict[str, Any]:
    """A colour per distinct series name, in first-seen order: tab10's while ten suffice, else tab20's, its
    ten dark shades before their light pairs (neighbours in tab20 are one hue)."""
    distinct = list(dict.fromkeys(names))
    if len(distinct) <= 10:
        return {name: plt.cm.tab10(i) for i, name in enumerate(distinct)}
    shades = [*range(0, 20, 2), *range(1, 20, 2)]
    return {name: plt.cm.tab20(shades[i % 20]) for i, name in enumerate(distinct)}


def _accuracy_by_step(record: RunRecord, task: str) -> dict[int, float]:
    """pass@1 of `task` at every evaluated step of a run (kept checkpoints, then the final model)."""
    points = {step: suites[suite]["tasks"][task]["value"] for step, suites in record.checkpoint_evals.items()
              for suite in suites if task in suites[suite].get("tasks", {})}
    points.update({len(record.metrics): value for name, value in record.scores().items() if name == task})
    return points


def accuracy_over_training_figures(records: list[RunRecord], tasks: list[str], out: Path) -> list[Path]:
    """Per model, beta and point of the extra axes, when checkpoints were evaluated (evaluate.every):
    pass@1 against the training step for every configuration (mean over seeds), the no-KL baseline
    dotted."""
    plt, extra, paths = _pyplot(), _extra(records), []
    for model, beta, point, members, baseline in _panels(records, lambda r: bool(r.checkpoint_evals)):
        fig, panels = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), dpi=110, squeeze=False)
        for ax, task in zip(panels[0], tasks, strict=True):
            by_label: dict[str, list[dict[int, float]]] = {}
            for record in members + baseline:
                by_label.setdefault(record.label, []).append(_accuracy_by_step(record, task))
            for label, runs in by_label.items():
                steps = sorted(set.intersection(*(set(r) for r in runs)))
                ax.plot(steps, [statistics.fmean(r[s] for r in runs) for s in steps], marker="o", label=label,
                        linestyle=":" if label == "no KL" else "-")
            ax.set_title(f"{task} pass@1")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        panels[0][0].legend(fontsize=7)
        paths.append(_finish(fig, f"{model}, beta = {beta}{_title(point, extra)}: accuracy over training (mean over "
                                  "seeds)", out / f"accuracy_vs_step_{model}_beta{beta}{_suffix(point)}.png"))
    return paths


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def reward_vs_kl_figures(records: list[RunRecord], out: Path) -> list[Path]:
    """Per model and point of the extra axes: each configuration's final reward against its
    KL(pi || pi_ref) on the held-out prompts (mean over seeds, bars: std), a colour per beta; the
    frontier of the optima pi*_beta of all betas (the most reward for a KL), and for each study beta
    the line of constant objective J = J* that touches it at pi*_beta: a run's vertical distance below
    its beta's line, times 1, is its gap."""
    extra, paths = _extra(records), []
    for model in sorted({r.coords["model"] for r in records}):
        measured = [r for r in records if r.coords["model"] == model and r.measured(None) is not None]
        reference = next((r.objective_reference for r in measured if r.objective_reference), None)
        if reference is None:
            continue
        for point in _points(measured, extra):
            mine = [r for r in measured if axes.covers(r.coords, point)]
            paths.append(_reward_vs_kl(mine, reference["histograms"], f"{model}{_title(point, extra)}",
                                       out / f"reward_vs_kl_{model}{_suffix(point)}.png"))
    return paths


def _reward_vs_kl(mine: list[RunRecord], histograms: list, title: str, path: Path) -> Path:
    plt = _pyplot()
    betas = sorted({float(r.coords["beta"]) for r in mine if r.coords["beta"] is not None})
    colors = {b: plt.cm.viridis(i / max(1, len(betas) - 1) * 0.85) for i, b in enumerate(betas)}
    fig, ax = plt.subplots(figsize=(7.5, 6.2), dpi=110)
    curve = frontier(histograms, np.geomspace(0.02, 20, 80)[::-1])
    ax.plot([k for _, k, _ in curve], [r for _, _, r in curve], color="black", lw=1, label="optimum's frontier")
    ax.plot([0], [statistics.fmean(reference_value(h) for h in histograms)],
            marker="s", color="black", linestyle="none", label=REFERENCE)
    groups: dict[tuple, list[dict[str, float]]] = {}
    for record in sorted(mine, key=lambda r: axes.sort_key(r.coords)):
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
                    marker=styles.estimator_marker(estimator), fillstyle=styles.placement_fill(placement),
                    markersize=7, color=color, capsize=2, linestyle="none", elinewidth=0.7)
    shown = {label.partition("-")[0] for _, label in groups}
    for estimator in estimators.REGISTRY.names:  # the key to the markers, in black
        if estimator in shown:
            ax.plot([], [], marker=styles.estimator_marker(estimator), color="black", linestyle="none",
                    label=estimator)
    shown_placements = {label.partition("-")[2] for _, label in groups}
    for placement in kl_placements():
        if placement in shown_placements:
            ax.plot([], [], marker="o", fillstyle=styles.placement_fill(placement), color="black", linestyle="none",
                    label=f"KL in the {placement}")
    if any(beta is None for beta, _ in groups):
        ax.plot([], [], marker="X", color="gray", linestyle="none", label="no KL")
    heights = [r for _, _, r in curve] + [statistics.fmean(m["reward"] for m in ms) for ms in groups.values()]
    ax.set_xlim(left=-0.02 * right, right=right * 1.15)
    ax.set_ylim(min(heights) - 0.05, max(heights) + 0.05)  # the J = J* lines run on out of view
    ax.set_xlabel("KL(pi || pi_ref) of whole completions, held-out prompts")
    ax.set_ylabel("mean reward, held-out prompts")
    ax.grid(alpha=0.3)
    # Below the axes: wherever the runs sit, a legend inside would cover some of them.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    return _finish(fig, f"{title}: reward against KL to the reference (final models, mean ± std over seeds)", path)


def all_figures(records: list[RunRecord], groups: list[Group], tasks: list[str], out: Path) -> list[Path]:
    """Every figure of the report (sweep.report.table's groups give the axis figures' numbers)."""
    return (curves_figures(records, out) + axis_figures(groups, tasks, out)
            + accuracy_over_training_figures(records, tasks, out) + reward_vs_kl_figures(records, out))
