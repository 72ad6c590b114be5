"""Paper-style tables from the run directories, as Markdown, LaTeX (booktabs) and CSV (the numbers are
sweep.report.table's, the figures sweep.report.figures').

Rows are estimator x placement, grouped by model, beta and the study's extra axes, with the no-KL
baseline in a group of its own. Columns are the evaluated tasks (pass@1), then the regularized
objective measured on held-out prompts: the gap J* - J(pi) at the row's beta, the KL to the reference
and the reward. A cell is mean +- std over seeds. Each beta group starts with the reference model's
own row (KL 0). A star marks a configuration that differs from k1-reward at the same other
coordinates by a paired t-test over seeds; the best mean of a column is bold; a dagger marks a
configuration with an unstable run, with the reasons under the table.

results.md/.tex/.csv hold every axis in the rows; results_by_<axis>.md/.tex put one axis in the
columns (each extra axis of the study, and any axis asked for), so that its values sit side by side.
provenance.csv says what made every number: each run's config digest and each evaluation's.

A report removes the files the one before it wrote and it does not (tables/.report_files lists them): a
study grown by an axis renames its figures (`..._kl_to-reference_...`), and the old names, left beside the
new, would show fewer seeds as if current. Files the report never wrote are left alone.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from sweep.report.table import (
    COMPARED_LABEL,
    OBJECTIVE_COLUMNS,
    REFERENCE,
    SIGNIFICANCE,
    Group,
    Row,
    Table,
    best_cells,
    extra_axes,
    layout,
    metric_names,
    summarize,
)
from sweep.runs import RunRecord, load_runs
from sweep.study import axes

log = logging.getLogger(__name__)


def _cell_text(row: Row, column: str, plus_minus: str = "±", star: str = "*") -> str:
    cell = row.cells.get(column)
    if cell is None:
        return ""
    if row.configuration == REFERENCE:
        return f"{cell.mean:.3f}"
    return f"{cell.mean:.3f} {plus_minus} {cell.std:.3f}" + (star if cell.significant else "")


def _seeds_text(row: Row) -> str:
    return "/".join(str(n) for n in sorted(set(row.seeds)))


def _headings(table: Table) -> list[str]:
    extra = [a for a in table.axes if a not in axes.STANDARD]
    return [axes.heading(a, extra) for a in table.axes]


def table_note(table: Table) -> str:
    """What the cells mean, and how significance was decided."""
    text = "Cells: mean ± std over seeds; bold: best mean of the column (per model; the objective per beta)."
    if any(metric in OBJECTIVE_COLUMNS for metric in table.metrics):
        text += (" Tasks: pass@1. On the held-out prompts of the runs' `measure` config: objective_gap = J* - J(pi) "
                 "= beta KL(pi || pi*) at the row's beta (lower is better), kl_to_ref = KL(pi || pi_ref) of whole "
                 "completions, reward = mean reward; `reference` is the reference model itself.")
    if any(c.p_value is not None for r in table.rows for c in r.cells.values()):
        seeds = "/".join(str(n) for n in sorted({n for r in table.rows if r.configuration != REFERENCE
                                                  for n in r.seeds}))
        same = ", ".join(h for a, h in zip(table.axes, _headings(table), strict=True) if a != "model")
        text += (f" *: differs from {COMPARED_LABEL} at the same {same or 'model'}, paired t-test over seeds "
                 f"({seeds} per configuration), two-sided p < {SIGNIFICANCE:g}; not corrected for multiple "
                 "comparisons.")
    if any(v == axes.NO_VALUE for r in table.rows for v in r.where.values()):
        text += " -: a coordinate the row's runs do not use (such as beta without KL)."
    return text + "\n"


def markdown_table(table: Table) -> str:
    best = best_cells(table)
    head = [*_headings(table), "configuration", "seeds", *table.columns]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "---|" * (len(table.axes) + 1) + "---:|" + "---:|" * len(table.columns)]
    notes = []
    for i, row in enumerate(table.rows):
        label = row.configuration + (" †" if row.unstable else "")
        cells = [f"**{_cell_text(row, c)}**" if (i, c) in best else _cell_text(row, c) for c in table.columns]
        lines.append("| " + " | ".join([*row.where.values(), label, _seeds_text(row), *cells]) + " |")
        where = ", ".join(v if a == "model" else f"{h} {v}"
                          for (a, v), h in zip(row.where.items(), _headings(table), strict=True))
        notes += [f"- {where}, {row.configuration}: {reason}" for reason in row.unstable]
    text = "\n".join(lines) + "\n\n" + table_note(table)
    if notes:
        text += "\n† unstable:\n" + "\n".join(notes) + "\n"
    return text


def _latex(text: str) -> str:
    return text.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("&", "\\&").replace("%", "\\%")


def latex_table(table: Table) -> str:
    best = best_cells(table)
    head = ["Model" if a == "model" else "$\\beta$" if a == "beta" else _latex(h)
            for a, h in zip(table.axes, _headings(table), strict=True)]
    lines = ["\\begin{tabular}{" + "l" * (len(table.axes) + 1) + "c" * len(table.columns) + "}", "\\toprule",
             " & ".join([*head, "Configuration", *(_latex(c) for c in table.columns)]) + " \\\\", "\\midrule"]
    previous = None
    for i, row in enumerate(table.rows):
        if previous is not None and (row.model, row.beta) != previous:
            lines.append("\\midrule")
        previous = (row.model, row.beta)
        cells = []
        for column in table.columns:
            text = _cell_text(row, column, "$\\pm$", "$^*$")
            cells.append(f"\\textbf{{{text}}}" if (i, column) in best else text)
        label = _latex(row.configuration) + ("$^\\dagger$" if row.unstable else "")
        lines.append(" & ".join([*(_latex(v) for v in row.where.values()), label, *cells]) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_csv(groups: list[Group], tasks: list[str], path: Path) -> None:
    """Tidy data: one line per configuration, point of the other axes (each extra axis a column, by
    its dotted key) and metric: tasks (pass@1), then objective_gap, kl_to_ref and reward;
    p_vs_k1_reward is the paired t-test's p-value (empty where there is no test)."""
    extra = extra_axes(groups)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "beta", *extra, "configuration", "task", "mean", "std", "seeds", "p_vs_k1_reward",
                         "unstable"])
        for group in groups:
            where = [axes.value_text(group.coords[k]) for k in ("model", "beta", *extra)]
            for name in metric_names(groups, tasks):
                if name in group.cells:
                    cell = group.cells[name]
                    p = "" if cell.p_value is None else f"{cell.p_value:.4g}"
                    writer.writerow([*where, group.label, name, f"{cell.mean:.6f}", f"{cell.std:.6f}",
                                     len(cell.values), p, "; ".join(group.unstable)])


def write_provenance(records: list[RunRecord], path: Path) -> None:
    """What made every number: a line per run (its training metrics: the objective, KL and reward columns)
    with its config digest (trainer.config.digest), then a line per evaluation (the task columns) with what
    made it (eval.provenance.digest; empty for one made before klstudy recorded it)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run_id", "configuration", "seed", "complete", "config_sha256", "evaluation",
                         "evaluation_sha256"])
        for record in records:
            run = [record.run_id, record.label, record.coords["seed"], int(record.complete), record.config_digest or ""]
            writer.writerow([*run, "", ""])
            for evaluation in record.evaluations():
                writer.writerow([*run, evaluation.where, evaluation.digest or ""])


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


def _made_by(scores: dict[str, Any]) -> str:
    """An evaluation's recorded settings and data, but its seed (each run's own): one table pools only
    evaluations that agree in these (eval.provenance; "" for one made before klstudy recorded it)."""
    made = scores.get("provenance")
    if not isinstance(made, dict):
        return ""
    return json.dumps({"settings": {k: v for k, v in (made.get("settings") or {}).items() if k != "seed"},
                       "data": made.get("data")}, sort_keys=True, default=str)


def check_one_way_made(records: list[RunRecord]) -> None:
    """ValueError where one model's evaluations of one suite were made with different settings or data: their
    rows and curves would pool them (the study stops before any job on such a change, sweep.study.changes; this
    guards a results directory changed by hand)."""
    seen: dict[tuple[str, str], tuple[str, Path]] = {}
    for record in records:
        for evaluation in record.evaluations():
            made, where = _made_by(evaluation.scores), (record.coords["model"], evaluation.suite)
            first = seen.setdefault(where, (made, evaluation.directory))
            if first[0] != made:
                raise ValueError(f"report: {where[0]}'s evaluations of {where[1]} were made otherwise in "
                                 f"{first[1]} than in {evaluation.directory} (their settings or data differ, in "
                                 "metrics.json's provenance), and a table would pool them: run the study, which says "
                                 "what changed, and run them again with --config rerun=changed")


def report(results: Path, study: str | None = None, uri: str | None = None, collapse_fraction: float = 0.5,
           columns: tuple[str, ...] = ()) -> dict[str, Any]:
    """Write results/tables and results/figures; log them to the study's parent run if `study`.
    `columns`: axes to put in the columns of a table of their own, besides the study's extra axes."""
    results = Path(results)
    records = load_runs(results)
    check_one_way_made(records)
    tables, figures = results / "tables", results / "figures"
    groups, tasks = summarize(records, collapse_fraction)
    extra = extra_axes(groups)
    pivots = list(dict.fromkeys([*extra, *columns]))
    layouts = {axis: layout(groups, tasks, axis) for axis in [None, *pivots]}  # bad axes fail before any write
    tables.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    written = []
    for axis, table in layouts.items():
        stem = "results" if axis is None else f"results_by_{axes.heading(axis, extra)}"
        (tables / f"{stem}.md").write_text(markdown_table(table))
        (tables / f"{stem}.tex").write_text(latex_table(table))
        written += [tables / f"{stem}.md", tables / f"{stem}.tex"]
    write_csv(groups, tasks, tables / "results.csv")
    write_provenance(records, tables / "provenance.csv")
    written += [tables / "results.csv", tables / "provenance.csv"]
    written += audit_tables(results / "audit" / "gradient_audit.csv", tables)
    from sweep.report import figures as draw  # matplotlib only here

    written += draw.all_figures(records, groups, tasks, figures)
    _remove_unwritten(results, written)
    if study is not None:
        from sweep.tracking.experiment import default_uri, open_study

        uri = uri or default_uri(results)
        client, _, parent = open_study(results, study, uri)
        for path in written:
            client.log_artifact(parent, str(path), artifact_path=path.parent.name)
        # the parent run's description in the UI (MLflow's note): the results table itself
        client.set_tag(parent, "mlflow.note.content", f"# {study}\n\n" + (tables / "results.md").read_text()
                       + "\nTables and figures: this run's artifacts `tables/` and `figures/`.\n")
    log.info("report: %d rows, %d tasks, %d files", len(layouts[None].rows), len(tasks), len(written))
    return {"rows": len(layouts[None].rows), "tasks": tasks, "files": [str(p) for p in written]}


REPORT_FILES = "tables/.report_files"  # under results: what the last report wrote, a path a line


def _remove_unwritten(results: Path, written: list[Path]) -> None:
    """Delete what the previous report wrote and this one did not; record what this one wrote."""
    manifest = results / REPORT_FILES
    now = [str(Path(path).relative_to(results)) for path in written]
    before = manifest.read_text().splitlines() if manifest.is_file() else []
    for name in sorted(set(before) - set(now)):
        (results / name).unlink(missing_ok=True)
        log.info("report: removed %s, which this report no longer writes", name)
    manifest.write_text("".join(f"{name}\n" for name in now))
