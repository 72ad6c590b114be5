"""Tables and figures on a fixture of known numbers."""

import csv

from study_fixture import write_study

from sweep.report import instability, report, table_rows
from sweep.runs import load_runs


def test_table_cells_are_mean_and_std_over_seeds_with_the_best_in_bold(tmp_path):
    results = write_study(tmp_path / "results")
    out = report(results)
    md = (results / "tables" / "results.md").read_text()
    # k1-reward: seeds 0.5 and 0.7 -> mean 0.600, sample std 0.141; the best of the column, in bold
    assert "| toy | 0.05 | k1-reward | 2 | **0.600 ± 0.141** |" in md
    assert "| toy | 0.05 | k3-loss † | 2 | 0.300 ± 0.141 |" in md
    assert "| toy | - | no KL | 1 | 0.600 ± 0.000 |" not in md  # ties are bold too
    assert "| toy | - | no KL | 1 | **0.600 ± 0.000** |" in md
    assert "seed 0: reward collapsed to" in md and "1 non-finite updates skipped" in md
    assert md.index("k1-reward") < md.index("k3-loss") < md.index("no KL")  # estimator x placement, baseline last
    tex = (results / "tables" / "results.tex").read_text()
    assert "\\toprule" in tex and "\\bottomrule" in tex and "\\textbf{0.600 $\\pm$ 0.141}" in tex
    assert "k3-loss$^\\dagger$" in tex
    rows = list(csv.DictReader((results / "tables" / "results.csv").open()))
    k1 = next(r for r in rows if r["configuration"] == "k1-reward")
    assert (k1["mean"], k1["std"], k1["seeds"]) == ("0.600000", "0.141421", "2")
    assert out["tasks"] == ["math500"]


def test_figures_are_written_and_not_empty(tmp_path):
    results = write_study(tmp_path / "results")
    files = report(results)["files"]
    figures = [f for f in files if f.endswith(".png")]
    assert {p.split("/")[-1] for p in figures} == {"curves_toy_beta0.05.png", "accuracy_vs_beta_toy.png"}
    for figure in figures:
        data = open(figure, "rb").read()
        assert data.startswith(b"\x89PNG") and len(data) > 20_000


def test_instability_flags_collapse_and_skipped_updates(tmp_path):
    results = write_study(tmp_path / "results")
    records = {r.run_id: r for r in load_runs(results)}
    assert instability(records["toy__k1-reward__b0.05__s0"]) == []
    reasons = instability(records["toy__k3-loss__b0.05__s0"])
    assert any("reward collapsed" in r for r in reasons) and any("non-finite" in r for r in reasons)
    assert instability(records["toy__k3-loss__b0.05__s0"], fraction=0.01) == ["1 non-finite updates skipped"]
    rows, tasks = table_rows(list(records.values()))
    assert [r.configuration for r in rows] == ["k1-reward", "k3-loss", "no KL"] and tasks == ["math500"]


def test_the_gradient_audit_table_is_included_when_the_audit_ran(tmp_path):
    results = write_study(tmp_path / "results")
    audit = results / "audit"
    audit.mkdir()
    (audit / "gradient_audit.csv").write_text(
        "sampling,estimator,placement,kl_loss_ratio,cos_kl,err_kl,verdict\n"
        "on-policy,k1,reward,none,1.0,1e-15,unbiased\n")
    report(results)
    assert "| on-policy | k1 | reward | none | 1 | 1e-15 | unbiased |" in (results / "tables" /
                                                                          "gradient_audit.md").read_text()


def test_columns_follow_the_suites_in_domain_first(tmp_path):
    from study_fixture import write_run

    results = tmp_path / "results"
    write_run(results, "a", "k1", "reward", 0.1, 0, [0.1, 0.2], {"mmlu_college_physics": 0.3, "math500": 0.2,
                                                                 "zz_custom": 0.1})
    assert table_rows(load_runs(results))[1] == ["math500", "mmlu_college_physics", "zz_custom"]
