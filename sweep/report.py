"""Paper-style tables from the run directories (the figures are sweep.figures).

Tables: rows are estimator x placement, grouped by model and beta, with the no-KL baseline in a
group of its own. Columns are the evaluated tasks (pass@1), then the regularized objective measured
on held-out prompts (trainer.objective_measure): the objective gap J* - J(pi) at the row's beta,
the KL to the reference and the reward. A cell is mean +- std over seeds. Each beta group starts
with the reference model's own row (KL 0). A star marks a configuration that differs from
k1-reward at the same beta by a paired t-test over seeds; the best mean of a column is bold; a
dagger marks a configuration with an unstable run, with the reasons under the table. Written as
Markdown, LaTeX (booktabs) and CSV.
"""

from __future__ import annotations

import csv
import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.suites import TASKS
from sweep.runs import RunRecord, load_runs

log = logging.getLogger(__name__)

ESTIMATOR_ORDER = {"k1": 0, "k2": 1, "k3": 2}
PLACEMENT_ORDER = {"reward": 0, "loss": 1, "reward+loss": 2}
NO_BETA = "-"
OBJECTIVE_COLUMNS = ("objective_gap", "kl_to_ref", "reward")  # after the tasks, in this order
LOWER_IS_BETTER, UNRANKED = {"objective_gap"}, {"kl_to_ref"}
COMPARED_TO = "k1-reward"  # the unbiased configuration every other one is tested against
REFERENCE = "reference"
SIGNIFICANCE = 0.05


def instability(record: RunRecord, fraction: float = 0.5) -> list[str]:
    """Why a run counts as unstable: reward or pass rate collapsing below `fraction` of its peak
    (on a moving average), or updates skipped for NaN/inf."""
    reasons = []
    for key, name in (("reward_mean", "reward"), ("pass_rate", "pass rate")):
        values = [float(m[key]) for m in record.metrics if key in m]
        if len(values) < 2:
            continue
        window = max(1, len(values) // 10)
        smooth = [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
        if max(smooth) > 0 and smooth[-1] < fraction * max(smooth):
            reasons.append(f"{name} collapsed to {smooth[-1]:.3f} from a peak of {max(smooth):.3f}")
    skipped = sum(float(m.get("skipped_updates", 0)) for m in record.metrics)
    if skipped:
        reasons.append(f"{int(skipped)} non-finite updates skipped")
    return reasons


@dataclass
class Cell:
    by_seed: dict[int, float] = field(default_factory=dict)
    p_value: float | None = None  # paired t-test against COMPARED_TO at the same beta, over common seeds

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
class Row:
    model: str
    beta: str
    configuration: str
    cells: dict[str, Cell] = field(default_factory=dict)
    unstable: list[str] = field(default_factory=list)
    seeds: int = 0


def sort_key(record: RunRecord) -> tuple:
    """Model, then beta, estimator and placement, the no-KL baseline last."""
    c = record.coords
    if c["placement"] == "none":
        return (c["model"], 1, 0.0, 0, 0)
    return (c["model"], 0, float(c["beta"]), ESTIMATOR_ORDER.get(c["estimator"], 9),
            PLACEMENT_ORDER.get(c["placement"], 9))


def objective_cells(record: RunRecord) -> dict[str, float]:
    """The final model's measured objective: gap at the run's beta (runs with KL), KL and reward."""
    measured = record.measured(record.coords["beta"])
    if measured is None:
        return {}
    cells = {"objective_gap": measured["gap"]} if "gap" in measured else {}
    return {**cells, "kl_to_ref": measured["kl"], "reward": measured["reward"]}


def reference_row(records: list[RunRecord], model: str, beta: str) -> Row | None:
    """The reference model's own objective at `beta` (KL 0), from the reward histograms its runs
    sampled before their first update; None when no run of the model measured them."""
    from trainer.optimum import objective_gap, reference_value

    found = next((r.objective_reference for r in records if r.coords["model"] == model and r.objective_reference),
                 None)
    if found is None or beta == NO_BETA:
        return None
    histograms = found["histograms"]
    rewards = [reference_value(h) for h in histograms]
    gap = objective_gap(histograms, rewards, [0.0] * len(rewards), float(beta))["gap"]
    cells = {"objective_gap": gap, "kl_to_ref": 0.0, "reward": statistics.fmean(rewards)}
    return Row(model, beta, REFERENCE, {name: Cell({0: value}) for name, value in cells.items()}, seeds=1)


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


def _mark_significance(rows: list[Row]) -> None:
    compared = {(r.model, r.beta): r for r in rows if r.configuration == COMPARED_TO}
    for row in rows:
        base = compared.get((row.model, row.beta))
        if base is None or row is base or row.configuration == REFERENCE:
            continue
        for name, cell in row.cells.items():
            if name in base.cells:
                cell.p_value = paired_p_value(cell.by_seed, base.cells[name].by_seed)


def table_rows(records: list[RunRecord], fraction: float = 0.5) -> tuple[list[Row], list[str]]:
    """Rows (seeds aggregated; each beta group led by the reference's row when the runs measured
    their objective) and the task columns, in a stable order."""
    found = {task for r in records for task in r.scores()}
    known = [task for task in TASKS if task in found]  # in-domain, then out-of-domain, as the suites say
    tasks = known + sorted(found - set(known))
    rows: dict[tuple, Row] = {}
    for record in sorted(records, key=sort_key):
        c = record.coords
        beta = NO_BETA if c["beta"] is None else f"{c['beta']:g}"
        if (c["model"], beta, REFERENCE) not in rows and (reference := reference_row(records, c["model"], beta)):
            rows[(c["model"], beta, REFERENCE)] = reference
        key = (c["model"], beta, record.label)
        row = rows.setdefault(key, Row(c["model"], beta, record.label))
        row.seeds += 1
        for name, value in {**record.scores(), **objective_cells(record)}.items():
            row.cells.setdefault(name, Cell()).by_seed[c["seed"]] = float(value)
        row.unstable += [f"seed {c['seed']}: {reason}" for reason in instability(record, fraction)]
    _mark_significance(list(rows.values()))
    return list(rows.values()), tasks


def columns(rows: list[Row], tasks: list[str]) -> list[str]:
    """The table's columns: the tasks, then the objective's columns that some row has."""
    return tasks + [name for name in OBJECTIVE_COLUMNS if any(name in r.cells for r in rows)]


def _best(rows: list[Row], names: list[str]) -> set[tuple[int, str]]:
    """(row, column) of the best mean: per model for tasks, per model and beta for the objective
    (a gap is relative to its beta); the lowest gap, no KL, and never the reference's row."""
    best = set()
    for name in names:
        if name in UNRANKED:
            continue
        groups: dict[tuple, list[tuple[int, float]]] = {}
        for i, r in enumerate(rows):
            if name in r.cells and r.configuration != REFERENCE:
                group = (r.model, r.beta) if name in OBJECTIVE_COLUMNS else (r.model,)
                groups.setdefault(group, []).append((i, r.cells[name].mean))
        for candidates in groups.values():
            if len(candidates) < 2:  # nothing to compare with (the no-KL baseline's own beta group)
                continue
            pick = min if name in LOWER_IS_BETTER else max
            top = pick(v for _, v in candidates)
            best |= {(i, name) for i, v in candidates if v == top}
    return best


def _cell_text(row: Row, name: str, plus_minus: str = "±", star: str = "*") -> str:
    cell = row.cells.get(name)
    if cell is None:
        return ""
    if row.configuration == REFERENCE:
        return f"{cell.mean:.3f}"
    return f"{cell.mean:.3f} {plus_minus} {cell.std:.3f}" + (star if cell.significant else "")


def _seeds_note(rows: list[Row]) -> str:
    seeds = sorted({r.seeds for r in rows if r.configuration not in (REFERENCE,)})
    return "/".join(str(s) for s in seeds) or "0"


def table_note(rows: list[Row], names: list[str]) -> str:
    """What the cells mean, and how significance was decided."""
    text = "Cells: mean ± std over seeds; bold: best mean of the column (per model; the objective per beta)."
    if any(name in OBJECTIVE_COLUMNS for name in names):
        text += (" Tasks: pass@1. On the held-out prompts of the runs' `measure` config: objective_gap = J* - J(pi) "
                 "= beta KL(pi || pi*) at the row's beta (lower is better), kl_to_ref = KL(pi || pi_ref) of whole "
                 "completions, reward = mean reward; `reference` is the reference model itself.")
    if any(c.p_value is not None for r in rows for c in r.cells.values()):
        text += (f" *: differs from {COMPARED_TO} at the same beta, paired t-test over seeds "
                 f"({_seeds_note(rows)} per configuration), two-sided p < {SIGNIFICANCE:g}; not corrected for "
                 "multiple comparisons.")
    return text + "\n"


def markdown_table(rows: list[Row], tasks: list[str]) -> str:
    names = columns(rows, tasks)
    best = _best(rows, names)
    lines = ["| model | beta | configuration | seeds | " + " | ".join(names) + " |",
             "|---|---|---|---:|" + "---:|" * len(names)]
    notes = []
    for i, row in enumerate(rows):
        label = row.configuration + (" †" if row.unstable else "")
        cells = [f"**{_cell_text(row, n)}**" if (i, n) in best else _cell_text(row, n) for n in names]
        lines.append(f"| {row.model} | {row.beta} | {label} | {row.seeds} | " + " | ".join(cells) + " |")
        notes += [f"- {row.model}, beta {row.beta}, {row.configuration}: {reason}" for reason in row.unstable]
    text = "\n".join(lines) + "\n\n" + table_note(rows, names)
    if notes:
        text += "\n† unstable:\n" + "\n".join(notes) + "\n"
    return text


def _latex(text: str) -> str:
    return text.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("&", "\\&").replace("%", "\\%")


def latex_table(rows: list[Row], tasks: list[str]) -> str:
    names = columns(rows, tasks)
    best = _best(rows, names)
    lines = ["\\begin{tabular}{lll" + "c" * len(names) + "}", "\\toprule",
             "Model & $\\beta$ & Configuration & " + " & ".join(_latex(n) for n in names) + " \\\\", "\\midrule"]
    previous = None
    for i, row in enumerate(rows):
        if previous is not None and (row.model, row.beta) != previous:
            lines.append("\\midrule")
        previous = (row.model, row.beta)
        cells = []
        for name in names:
            text = _cell_text(row, name, "$\\pm$", "$^*$")
            cells.append(f"\\textbf{{{text}}}" if (i, name) in best else text)
        label = _latex(row.configuration) + ("$^\\dagger$" if row.unstable else "")
        lines.append(f"{_latex(row.model)} & {row.beta} & {label} & " + " & ".join(cells) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[Row], tasks: list[str], path: Path) -> None:
    """One line per row and column: tasks (pass@1), then objective_gap, kl_to_ref and reward;
    p_vs_k1_reward is the paired t-test's p-value (empty where there is no test)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "beta", "configuration", "task", "mean", "std", "seeds", "p_vs_k1_reward",
                         "unstable"])
        for row in rows:
            for name in columns(rows, tasks):
                if name in row.cells:
                    cell = row.cells[name]
                    p = "" if cell.p_value is None else f"{cell.p_value:.4g}"
                    writer.writerow([row.model, row.beta, row.configuration, name, f"{cell.mean:.6f}",
                                     f"{cell.std:.6f}", len(cell.values), p, "; ".join(row.unstable)])


def audit_tables(audit_csv: Path, out: Path) -> list[Path]:
    """The gradient audit's verdict table (from `python -m trainer audit --out`), as Markdown and LaTeX."""
    if not audit_csv.is_file():
        return []
    with audit_csv.open() as handle:
        rows = list(csv.DictReader(handle))
    header = ["sampling", "estimator", "placement", "kl_loss_ratio", "cos_kl", "err_kl", "verdict"]
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    tex = ["\\begin{tabular}{llllrrl}", "\\toprule", " & ".join(_latex(h) for h in header) + " \\\\", "\\midrule"]
    for r in rows:
        values = [r[h] if h not in ("cos_kl", "err_kl") else f"{float(r[h]):.3g}" for h in header]
        md.append("| " + " | ".join(values) + " |")
        tex.append(" & ".join(_latex(v) for v in values) + " \\\\")
    tex += ["\\bottomrule", "\\end{tabular}"]
    paths = [out / "gradient_audit.md", out / "gradient_audit.tex"]
    paths[0].write_text("\n".join(md) + "\n")
    paths[1].write_text("\n".join(tex) + "\n")
    return paths


def report(results: Path, study: str | None = None, uri: str | None = None,
           collapse_fraction: float = 0.5) -> dict[str, Any]:
    """Write results/tables and results/figures; log them to the study's parent run if `study`."""
    results = Path(results)
    records = load_runs(results)
    tables, figures = results / "tables", results / "figures"
    tables.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    rows, tasks = table_rows(records, collapse_fraction)
    (tables / "results.md").write_text(markdown_table(rows, tasks))
    (tables / "results.tex").write_text(latex_table(rows, tasks))
    write_csv(rows, tasks, tables / "results.csv")
    written = [tables / "results.md", tables / "results.tex", tables / "results.csv"]
    written += audit_tables(results / "audit" / "gradient_audit.csv", tables)
    from sweep import figures as draw  # matplotlib only here

    written += draw.curves_figures(records, figures)
    written += draw.accuracy_vs_beta_figures([r for r in rows if r.configuration != REFERENCE], tasks, figures)
    written += draw.accuracy_over_training_figures(records, tasks, figures)
    written += draw.reward_vs_kl_figures(records, figures)
    if study is not None:
        from sweep.tracking import default_uri, open_study, sync_lock

        uri = uri or default_uri(results)
        with sync_lock(results):
            client, _, parent = open_study(results, study, uri)
            for path in written:
                client.log_artifact(parent, str(path), artifact_path=path.parent.name)
            # the parent run's description in the UI (MLflow's note): the results table itself
            client.set_tag(parent, "mlflow.note.content", f"# {study}\n\n" + (tables / "results.md").read_text()
                           + "\nTables and figures: this run's artifacts `tables/` and `figures/`.\n")
    log.info("report: %d rows, %d tasks, %d files", len(rows), len(tasks), len(written))
    return {"rows": len(rows), "tasks": tasks, "files": [str(p) for p in written]}
