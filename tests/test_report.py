"""Tables and figures on a fixture of known numbers."""

import csv

import pytest
from study_fixture import write_run, write_study

from sweep.report import instability, report, table_rows
from sweep.runs import load_runs


def test_table_cells_are_mean_and_std_over_seeds_with_the_best_in_bold(tmp_path):
    results = write_study(tmp_path / "results")
    out = report(results)
    md = (results / "tables" / "results.md").read_text()
    # k1-reward: seeds 0.5 and 0.7 -> mean 0.600, sample std 0.141; the best of the column, in bold
    assert "| toy | 0.05 | k1-reward | 2 | **0.600 ± 0.141** |" in md
    assert "| toy | 0.05 | k3-loss † | 2 | 0.300 ± 0.141* |" in md  # 0.3 below k1-reward on both seeds
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
    results = tmp_path / "results"
    write_run(results, "a", "k1", "reward", 0.1, 0, [0.1, 0.2], {"mmlu_college_physics": 0.3, "math500": 0.2,
                                                                 "zz_custom": 0.1})
    assert table_rows(load_runs(results))[1] == ["math500", "mmlu_college_physics", "zz_custom"]


def test_the_objective_columns_the_reference_row_and_paired_significance(tmp_path):
    """Per-prompt measurements with known gaps: k3-loss is worse than k1-reward by the same amount on
    both seeds (a paired t-test finds it), and the reference's row leads the beta group."""
    import math

    import scipy.stats

    from sweep.report import paired_p_value
    from trainer.optimum import optimal_value

    results = tmp_path / "results"
    for seed, kl in ((0, 0.1), (1, 0.3)):
        write_run(results, f"toy__k1-reward__b0.5__s{seed}", "k1", "reward", 0.5, seed, [0.5, 0.6], {"arith": 0.6},
                  measured=([0.75, 0.5], [kl, kl]))
        write_run(results, f"toy__k1-loss__b0.5__s{seed}", "k1", "loss", 0.5, seed, [0.5, 0.6], {"arith": 0.5},
                  measured=([0.5, 0.25], [kl + 1.0, kl + 1.0]))
    write_run(results, "toy__none__s0", "k1", "none", 0.0, 0, [0.5, 0.5], {"arith": 0.4}, measured=([1.0, 0.5], [2, 4]))
    report(results)
    optimum = (optimal_value([(0, 1), (1, 1)], 0.5) + optimal_value([(0, 3), (1, 1)], 0.5)) / 2
    rows = {(r["configuration"], r["task"]): r for r in csv.DictReader((results / "tables" / "results.csv").open())}
    reference_gap = optimum - 0.375  # KL 0, reward the mean pass rate
    assert float(rows["reference", "objective_gap"]["mean"]) == pytest.approx(reference_gap, abs=1e-6)
    assert rows["reference", "kl_to_ref"]["mean"] == "0.000000" and rows["reference", "reward"]["mean"] == "0.375000"
    gap = optimum - (0.625 - 0.5 * 0.2)  # mean over seeds of J* - (reward - beta KL)
    assert float(rows["k1-reward", "objective_gap"]["mean"]) == pytest.approx(gap, abs=1e-6)
    assert float(rows["k1-reward", "objective_gap"]["std"]) == pytest.approx(0.5 * 0.2 / math.sqrt(2), abs=1e-6)
    assert float(rows["k1-loss", "objective_gap"]["mean"]) == pytest.approx(gap + 0.25 + 0.5, abs=1e-6)
    assert float(rows["k1-loss", "objective_gap"]["p_vs_k1_reward"]) < 1e-9  # the same difference on both seeds
    assert rows["k1-reward", "objective_gap"]["p_vs_k1_reward"] == ""
    assert ("no KL", "objective_gap") not in rows and rows["no KL", "kl_to_ref"]["mean"] == "3.000000"
    md = (results / "tables" / "results.md").read_text()
    assert md.index("| reference |") < md.index("| k1-reward |")
    assert "| toy | 0.5 | k1-loss | 2 | 0.500 ± 0.000* |" in md  # arith pass@1: 0.5 on both seeds, 0.6 for k1-reward
    assert "paired t-test over seeds" in md and "objective_gap = J* - J(pi)" in md
    assert "$^*$" in (results / "tables" / "results.tex").read_text()
    figure = results / "figures" / "reward_vs_kl_toy.png"
    assert figure.read_bytes().startswith(b"\x89PNG") and figure.stat().st_size > 20_000
    a, b = {0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.0, 1: 0.0, 2: 0.0, 3: 9.0}  # seed 3 has no pair
    assert paired_p_value(a, b) == pytest.approx(scipy.stats.ttest_rel([1, 2, 4], [0, 0, 0]).pvalue)
    assert paired_p_value({0: 1.0}, {0: 0.0}) is None
