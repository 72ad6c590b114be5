"""Paper-style tables and figures from the run directories.

Tables: rows are estimator x placement, grouped by model and beta, with the no-KL baseline in a
group of its own; columns are the evaluated tasks; a cell is mean +- std of pass@1 over seeds. The
best mean of each column within a model is bold; a configuration with an unstable run is marked
with a dagger and the reasons are listed under the table. Written as Markdown, LaTeX (booktabs)
and CSV. Figures: training curves per configuration with the spread over seeds shaded, and
accuracy against beta.
"""

from __future__ import annotations

import csv
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.suites import TASKS
from sweep.runs import RunRecord, load_runs

log = logging.getLogger(__name__)

CURVES = ("reward_mean", "kl_k3", "entropy", "response_length")
ESTIMATOR_ORDER = {"k1": 0, "k2": 1, "k3": 2}
PLACEMENT_ORDER = {"reward": 0, "loss": 1, "reward+loss": 2}
NO_BETA = "-"


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
    values: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0


@dataclass
class Row:
    model: str
    beta: str
    configuration: str
    cells: dict[str, Cell] = field(default_factory=dict)
    unstable: list[str] = field(default_factory=list)
    seeds: int = 0


def _order(record: RunRecord) -> tuple:
    c = record.coords
    if c["placement"] == "none":
        return (c["model"], 1, 0.0, 0, 0)
    return (c["model"], 0, float(c["beta"]), ESTIMATOR_ORDER.get(c["estimator"], 9),
            PLACEMENT_ORDER.get(c["placement"], 9))


def table_rows(records: list[RunRecord], fraction: float = 0.5) -> tuple[list[Row], list[str]]:
    """Rows (seeds aggregated) and the task columns, in a stable order."""
    found = {task for r in records for task in r.scores()}
    known = [task for task in TASKS if task in found]  # in-domain, then out-of-domain, as the suites say
    tasks = known + sorted(found - set(known))
    rows: dict[tuple, Row] = {}
    for record in sorted(records, key=_order):
        c = record.coords
        beta = NO_BETA if c["beta"] is None else f"{c['beta']:g}"
        key = (c["model"], beta, record.label)
        row = rows.setdefault(key, Row(c["model"], beta, record.label))
        row.seeds += 1
        for task, value in record.scores().items():
            row.cells.setdefault(task, Cell()).values.append(float(value))
        row.unstable += [f"seed {c['seed']}: {reason}" for reason in instability(record, fraction)]
    return list(rows.values()), tasks


def _best(rows: list[Row], tasks: list[str]) -> set[tuple[int, str]]:
    best = set()
    for model in {r.model for r in rows}:
        for task in tasks:
            candidates = [(i, r.cells[task].mean) for i, r in enumerate(rows) if r.model == model and task in r.cells]
            if candidates:
                top = max(v for _, v in candidates)
                best |= {(i, task) for i, v in candidates if v == top}
    return best


def _cell_text(row: Row, task: str) -> str:
    cell = row.cells.get(task)
    return "" if cell is None else f"{cell.mean:.3f} ± {cell.std:.3f}"


def markdown_table(rows: list[Row], tasks: list[str]) -> str:
    best = _best(rows, tasks)
    lines = ["| model | beta | configuration | seeds | " + " | ".join(tasks) + " |",
             "|---|---|---|---:|" + "---:|" * len(tasks)]
    notes = []
    for i, row in enumerate(rows):
        label = row.configuration + (" †" if row.unstable else "")
        cells = [f"**{_cell_text(row, t)}**" if (i, t) in best else _cell_text(row, t) for t in tasks]
        lines.append(f"| {row.model} | {row.beta} | {label} | {row.seeds} | " + " | ".join(cells) + " |")
        notes += [f"- {row.model}, beta {row.beta}, {row.configuration}: {reason}" for reason in row.unstable]
    text = "\n".join(lines) + "\n\nCells: pass@1, mean ± std over seeds; bold: best mean of the column for the model.\n"
    if notes:
        text += "\n† unstable:\n" + "\n".join(notes) + "\n"
    return text


def _latex(text: str) -> str:
    return text.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("&", "\\&").replace("%", "\\%")


def latex_table(rows: list[Row], tasks: list[str]) -> str:
    best = _best(rows, tasks)
    lines = ["\\begin{tabular}{lll" + "c" * len(tasks) + "}", "\\toprule",
             "Model & $\\beta$ & Configuration & " + " & ".join(_latex(t) for t in tasks) + " \\\\", "\\midrule"]
    previous = None
    for i, row in enumerate(rows):
        if previous is not None and (row.model, row.beta) != previous:
            lines.append("\\midrule")
        previous = (row.model, row.beta)
        cells = []
        for t in tasks:
            cell = row.cells.get(t)
            text = "" if cell is None else f"{cell.mean:.3f} $\\pm$ {cell.std:.3f}"
            cells.append(f"\\textbf{{{text}}}" if (i, t) in best else text)
        label = _latex(row.configuration) + ("$^\\dagger$" if row.unstable else "")
        lines.append(f"{_latex(row.model)} & {row.beta} & {label} & " + " & ".join(cells) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[Row], tasks: list[str], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "beta", "configuration", "task", "mean", "std", "seeds", "unstable"])
        for row in rows:
            for task in tasks:
                if task in row.cells:
                    cell = row.cells[task]
                    writer.writerow([row.model, row.beta, row.configuration, task, f"{cell.mean:.6f}",
                                     f"{cell.std:.6f}", len(cell.values), "; ".join(row.unstable)])


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


# --- figures ------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, title: str, path: Path) -> Path:
    """Title, lay out, save and close a figure."""
    plt = _pyplot()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_curves_figure(record: RunRecord, path: Path) -> Path:
    """One run's reward, KL, entropy and length over steps (logged with its MLflow run)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3), dpi=100)
    steps = [m["step"] for m in record.metrics]
    for ax, key in zip(axes, CURVES, strict=True):
        ax.plot(steps, [m.get(key, float("nan")) for m in record.metrics])
        ax.set_title(key)
        ax.set_xlabel("step")
    return _finish(fig, record.run_id, path)


def curves_figures(records: list[RunRecord], out: Path) -> list[Path]:
    """Per model and beta: every configuration's curves (mean over seeds, min-max shaded)."""
    plt = _pyplot()
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for record in records:
        c = record.coords
        if c["placement"] != "none":
            groups.setdefault((c["model"], f"{c['beta']:g}"), []).append(record)
    baselines = [r for r in records if r.coords["placement"] == "none"]
    paths = []
    for (model, beta), members in sorted(groups.items()):
        members = members + [r for r in baselines if r.coords["model"] == model]
        fig, axes = plt.subplots(1, len(CURVES), figsize=(4.5 * len(CURVES), 3.6), dpi=110)
        by_label: dict[str, list[RunRecord]] = {}
        for record in sorted(members, key=_order):
            by_label.setdefault(record.label, []).append(record)
        for ax, key in zip(axes, CURVES, strict=True):
            for label, runs in by_label.items():
                length = min(len(r.metrics) for r in runs)
                if length == 0:
                    continue
                series = [[float(r.metrics[i].get(key, float("nan"))) for r in runs] for i in range(length)]
                mean = [statistics.fmean(s) for s in series]
                ax.plot(range(length), mean, label=label, linestyle=":" if label == "no KL" else "-")
                if len(runs) > 1:
                    ax.fill_between(range(length), [min(s) for s in series], [max(s) for s in series], alpha=0.2)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        paths.append(_finish(fig, f"{model}, beta = {beta} (mean over seeds, min-max shaded)",
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
            for record in sorted(members, key=_order):
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
    written += curves_figures(records, figures)
    written += accuracy_vs_beta_figures(rows, tasks, figures)
    written += accuracy_over_training_figures(records, tasks, figures)
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
