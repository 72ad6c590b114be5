"""The numbers of the report's tables: per configuration and point of the other axes, each metric's
values over seeds; the paired tests against k1-reward; the rows of a table, with any axis in the
columns.

A metric is an evaluated task's pass@1, or the regularized objective measured on held-out prompts
(trainer.measure.objective): the gap J* - J(pi) at the run's beta, the KL to the reference and the
reward. Every (model, beta) with measured runs also gets the reference model's own values (KL 0).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from eval.suites import TASKS
from sweep.runs import RunRecord
from sweep.study import axes

OBJECTIVE_COLUMNS = ("objective_gap", "kl_to_ref", "reward")  # after the tasks, in this order
LOWER_IS_BETTER, UNRANKED = {"objective_gap"}, {"kl_to_ref"}
COMPARED_TO = {"estimator": "k1", "placement": "reward"}  # the unbiased configuration the others are tested against
COMPARED_LABEL = "k1-reward"
REFERENCE = "reference"
SIGNIFICANCE = 0.05


ESS_WARNING = 0.5  # an `ess` this low: most of a step's importance weight on a few of its tokens


def _smoothed(values: list[float]) -> list[float]:
    """A trailing moving average over a tenth of the run (at least one step)."""
    window = max(1, len(values) // 10)
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def _first(values: list[float], below: float, start: int = 0) -> int | None:
    return next((i for i in range(start, len(values)) if values[i] < below), None)


def _warning(record: RunRecord, fell: int) -> str:
    """When, against the reward's fall at index `fell`, the run's smoothed `ess` first fell below ESS_WARNING:
    the early warning that an off-policy collapse is coming, or its absence."""
    ess = [float(m["ess"]) for m in record.metrics if "ess" in m]
    if len(ess) != len(record.metrics):
        return ""
    steps = [m["step"] for m in record.metrics]
    warned = _first(_smoothed(ess), ESS_WARNING)
    if warned is None:
        return f"; its ess stayed above {ESS_WARNING}"
    lead = steps[fell] - steps[warned]
    when = f"{lead} steps before" if lead > 0 else ("at the same step as" if lead == 0 else f"{-lead} steps after")
    return f"; its ess fell below {ESS_WARNING} at step {steps[warned]}, {when} the fall (step {steps[fell]})"


def instability(record: RunRecord, fraction: float = 0.5) -> list[str]:
    """Why a run counts as unstable: reward or pass rate collapsing below `fraction` of its peak
    (on a moving average), or updates skipped for NaN/inf. A reward's collapse says when the run's
    `ess` fell below ESS_WARNING, against the step the reward first fell below the bound after its peak."""
    reasons = []
    for key, name in (("reward_mean", "reward"), ("pass_rate", "pass rate")):
        values = [float(m[key]) for m in record.metrics if key in m]
        if len(values) < 2:
            continue
        smooth = _smoothed(values)
        if max(smooth) > 0 and smooth[-1] < fraction * max(smooth):
            peak = smooth.index(max(smooth))
            fell = _first(smooth, fraction * max(smooth), peak)
            warning = _warning(record, fell) if key == "reward_mean" else ""
            reasons.append(f"{name} collapsed to {smooth[-1]:.3f} from a peak of {max(smooth):.3f}{warning}")
    skipped = sum(float(m.get("skipped_updates", 0)) for m in record.metrics)
    if skipped:
        reasons.append(f"{int(skipped)} non-finite updates skipped")
    return reasons


@dataclass
class Cell:
    by_seed: dict[int, float] = field(default_factory=dict)
    p_value: float | None = None  # paired t-test against k1-reward at the same other coordinates, common seeds

    @property
    def values(self) -> list[float]:
        return list(self.by_seed.values())

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    @property
    def significant(self) -> bool:
        return self.p_value is not None and self.p_value < SIGNIFICANCE


@dataclass
class Group:
    """One configuration at one point of the other axes (every coordinate but the seed), over seeds."""

    coords: dict[str, Any]
    label: str  # estimator-placement, `no KL` or `reference`
    cells: dict[str, Cell] = field(default_factory=dict)
    unstable: list[str] = field(default_factory=list)
    seeds: int = 0

    @property
    def reference(self) -> bool:
        return self.label == REFERENCE

    def order(self) -> tuple:
        """Model, beta (the baseline last), the reference first, then the extra axes and the configuration."""
        key = axes.sort_key({**self.coords, "seed": 0})
        return key[:3] + (0 if self.reference else 1,) + key[3:]


def paired_p_value(a: dict[int, float], b: dict[int, float]) -> float | None:
    """Two-sided p-value of a paired t-test of a against b over their common seeds (None below 2)."""
    from scipy import stats

    seeds = sorted(a.keys() & b.keys())
    if len(seeds) < 2:
        return None
    differences = [a[s] - b[s] for s in seeds]
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = mean / (sd / math.sqrt(len(seeds)))
    return float(2 * stats.t.sf(abs(t), len(seeds) - 1))


def objective_cells(record: RunRecord) -> dict[str, float]:
    """The final model's measured objective: gap at the run's beta (runs with KL; an adaptive beta: the one it
    ended with), KL and reward."""
    measured = record.measured(record.final_beta)
    if measured is None:
        return {}
    cells = {"objective_gap": measured["gap"]} if "gap" in measured else {}
    return {**cells, "kl_to_ref": measured["kl"], "reward": measured["reward"]}


def _reference(records: list[RunRecord], where: dict[str, Any]) -> Group | None:
    """The reference model's own objective at `where` (its model and beta; KL 0), from the reward
    histograms its runs sampled before their first update; None when no run of the model measured them."""
    from trainer.measure.optimum import objective_gap, reference_value

    found = next((r.objective_reference for r in records
                  if r.coords["model"] == where["model"] and r.objective_reference), None)
    if found is None:
        return None
    histograms = found["histograms"]
    rewards = [reference_value(h) for h in histograms]
    gap = objective_gap(histograms, rewards, [0.0] * len(rewards), float(where["beta"]))["gap"]
    values = {"objective_gap": gap, "kl_to_ref": 0.0, "reward": statistics.fmean(rewards)}
    return Group(where, REFERENCE, {name: Cell({0: value}) for name, value in values.items()}, seeds=1)


def _key(coords: dict[str, Any]) -> str:
    return "\x1f".join(f"{k}={axes.value_text(v)}" for k, v in coords.items())


def summarize(records: list[RunRecord], fraction: float = 0.5) -> tuple[list[Group], list[str]]:
    """Every configuration's cells over seeds, ordered, each (model, beta) led by the reference's values,
    with the paired tests against k1-reward; and the task columns in a stable order."""
    found = {task for r in records for task in r.scores()}
    known = [task for task in TASKS if task in found]  # in-domain, then out-of-domain, as the suites say
    tasks = known + sorted(found - set(known))
    groups: dict[str, Group] = {}
    for record in records:
        coords = dict(record.coords)
        seed = coords.pop("seed")
        group = groups.setdefault(_key(coords), Group(coords, record.label))
        group.seeds += 1
        for name, value in {**record.scores(), **objective_cells(record)}.items():
            group.cells.setdefault(name, Cell()).by_seed[seed] = float(value)
        group.unstable += [f"seed {seed}: {reason}" for reason in instability(record, fraction)]
        if coords["beta"] is not None:  # once per model and beta: the reference's coordinates are those alone
            where = {key: None for key in coords} | {"model": coords["model"], "beta": coords["beta"],
                                                     "placement": REFERENCE}
            if _key(where) not in groups and (reference := _reference(records, where)) is not None:
                groups[_key(where)] = reference
    _mark_significance(groups)
    return sorted(groups.values(), key=Group.order), tasks


def _mark_significance(groups: dict[str, Group]) -> None:
    """p-values against k1-reward at the same coordinates (those k1-reward uses: it has no KL loss ratio; a
    library's preset is part of the configuration, as the estimator and placement are)."""
    compared = [g for g in groups.values() if all(g.coords[k] == v for k, v in COMPARED_TO.items())]
    for group in groups.values():
        if group.reference or group.coords["placement"] == "none" or group in compared:
            continue
        others = {k: v for k, v in group.coords.items() if k not in COMPARED_TO and k != axes.PRESET}
        base = next((g for g in compared if axes.covers(g.coords, others)), None)
        if base is None:
            continue
        for name, cell in group.cells.items():
            if name in base.cells:
                cell.p_value = paired_p_value(cell.by_seed, base.cells[name].by_seed)


def metric_names(groups: list[Group], tasks: list[str]) -> list[str]:
    """The tasks, then the objective's columns that some group has."""
    return tasks + [name for name in OBJECTIVE_COLUMNS if any(name in g.cells for g in groups)]


@dataclass
class Row:
    """A table row: its coordinates as text (model, beta, extra axes; not the axis in the columns), its
    configuration, and cells keyed by column."""

    where: dict[str, str]
    configuration: str
    cells: dict[str, Cell] = field(default_factory=dict)
    unstable: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.where.get("model", "")

    @property
    def beta(self) -> str:
        return self.where.get("beta", "")


@dataclass
class Table:
    rows: list[Row]
    columns: list[str]      # cell columns, in order
    metrics: list[str]      # each column's metric
    axes: list[str]         # the row coordinates shown, in order (model, beta, extra axes; not `columns_axis`)
    columns_axis: str | None = None


def extra_axes(groups: list[Group]) -> list[str]:
    """The extra axes of the groups (every group has the same coordinates)."""
    return axes.extra_of(groups[0].coords) if groups else []


def layout(groups: list[Group], tasks: list[str], columns_axis: str | None = None) -> Table:
    """The table of `groups`: a row per configuration and point of the row axes, a column per metric
    (and per value of `columns_axis`, when given: any axis but the seed). The reference's values hold
    for every value of an axis other than model and beta."""
    extra = extra_axes(groups)
    choices = ["model", "estimator", "placement", "beta", *extra]
    columns_axis = next((k for k in extra if columns_axis == axes.header(k, extra)), columns_axis)  # async_level
    if columns_axis is not None and columns_axis not in choices:
        raise ValueError(f"--columns: {columns_axis!r} is not an axis of these runs (axes: {', '.join(choices)})")
    shown = [a for a in ("model", "beta", *extra) if a != columns_axis]
    spread = columns_axis not in (None, "model", "beta")  # the reference's row fills every column

    def at(value: Any) -> str:  # async_level=8
        return f"{axes.heading(columns_axis, extra)}={axes.value_text(value)}"

    def column(metric: str, value: Any) -> str:
        return metric if columns_axis is None else f"{metric} ({at(value)})"

    values = list(dict.fromkeys(g.coords[columns_axis] for g in groups if not (spread and g.reference))) \
        if columns_axis else [None]
    placed = [({a: axes.value_text(g.coords[a]) for a in shown}, _label(g, columns_axis), g) for g in groups]
    rows: dict[str, tuple[tuple, Row]] = {}  # key -> (order, row)
    for where, label, group in placed:
        value = group.coords[columns_axis] if columns_axis else None
        for home in _homes(where, label, placed):
            order, row = rows.setdefault(_key({**home, "configuration": label}), (group.order(), Row(home, label)))
            if home == where:  # the row's own group orders it, not one spread into it
                rows[_key({**home, "configuration": label})] = (group.order(), row)
            for metric, cell in group.cells.items():
                for target in values if spread and group.reference else [value]:
                    row.cells[column(metric, target)] = cell
            prefix = f"{at(value)}, " if columns_axis else ""
            row.unstable += [prefix + reason for reason in group.unstable]
            row.seeds.append(group.seeds)
    ordered = [row for _, row in sorted(rows.values(), key=lambda item: item[0])]
    wanted = [(column(m, v), m) for m in metric_names(groups, tasks) for v in values]
    used = [(name, m) for name, m in wanted if any(name in r.cells for r in ordered)]
    return Table(ordered, [n for n, _ in used], [m for _, m in used], shown, columns_axis)


def _homes(where: dict[str, str], label: str, placed: list[tuple[dict[str, str], str, Group]]) -> list[dict[str, str]]:
    """The rows a group's cells go in: its own; or, where it lacks a coordinate that rows of its label
    have (k1 with the KL in the reward has no KL loss ratio, k1 with it in the loss has one, and the
    placement is in the columns), each of those rows."""
    unused = [a for a, v in where.items() if v == axes.NO_VALUE]
    if not unused:
        return [where]
    found = {_key(w): w for w, other, _ in placed if other == label and all(w[a] != axes.NO_VALUE for a in unused)
             and all(w[a] == v for a, v in where.items() if a not in unused)}
    return list(found.values()) or [where]


def _label(group: Group, columns_axis: str | None) -> str:
    """The configuration's label without the axis in the columns (estimator or placement)."""
    if group.reference or group.coords["placement"] == "none" or columns_axis not in ("estimator", "placement"):
        return group.label
    return group.coords["placement" if columns_axis == "estimator" else "estimator"]


def best_cells(table: Table) -> set[tuple[int, str]]:
    """(row, column) of the best mean of each column: per model for tasks, per model and beta for the
    objective (a gap is relative to its beta); the lowest gap, no KL, and never the reference's row."""
    best = set()
    for column, metric in zip(table.columns, table.metrics, strict=True):
        if metric in UNRANKED:
            continue
        groups: dict[tuple, list[tuple[int, float]]] = {}
        for i, row in enumerate(table.rows):
            if column in row.cells and row.configuration != REFERENCE:
                group = (row.model, row.beta) if metric in OBJECTIVE_COLUMNS else (row.model,)
                groups.setdefault(group, []).append((i, row.cells[column].mean))
        for candidates in groups.values():
            if len(candidates) < 2:  # nothing to compare with (the no-KL baseline's own beta group)
                continue
            top = (min if metric in LOWER_IS_BETTER else max)(v for _, v in candidates)
            best |= {(i, column) for i, v in candidates if v == top}
    return best
