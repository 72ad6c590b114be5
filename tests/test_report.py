"""Tables and figures on a fixture of known numbers."""

import csv
from pathlib import Path

import pytest
from study_fixture import write_offpolicy_study, write_run, write_study

from sweep.report.build import report
from sweep.report.table import instability, summarize
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
    # one beta: nothing to draw against beta
    assert {p.split("/")[-1] for p in figures} == {"curves_toy_beta0.05.png"}
    for figure in figures:
        data = open(figure, "rb").read()
        assert data.startswith(b"\x89PNG") and len(data) > 20_000


def test_an_axis_figures_series_keep_one_colour_each_past_ten():
    """A grown study draws a dozen lines against its async level: each its own colour, the same in every
    panel (a panel without the no-KL baseline's gap must not shift the others' colours)."""
    from sweep.report.figures import _pyplot, _series_colors

    names = [f"series {i}" for i in range(12)]
    colors = _series_colors(_pyplot(), names + names[:3])
    assert list(colors) == names and len(set(colors.values())) == 12


def test_instability_flags_collapse_and_skipped_updates(tmp_path):
    results = write_study(tmp_path / "results")
    records = {r.run_id: r for r in load_runs(results)}
    assert instability(records["toy__k1-reward__b0.05__s0"]) == []
    reasons = instability(records["toy__k3-loss__b0.05__s0"])
    assert any("reward collapsed" in r for r in reasons) and any("non-finite" in r for r in reasons)
    assert instability(records["toy__k3-loss__b0.05__s0"], fraction=0.01) == ["1 non-finite updates skipped"]
    groups, tasks = summarize(list(records.values()))
    assert [g.label for g in groups] == ["k1-reward", "k3-loss", "no KL"] and tasks == ["math500"]


def test_a_collapse_says_when_the_runs_ess_fell_against_its_rewards_fall():
    """The off-policy early warning in the table's notes: the step at which the smoothed ess first fell below
    0.5, against the step at which the smoothed reward first fell below half its peak after the peak."""
    from sweep.runs import RunRecord

    def run(ess):
        rewards = [0.2] * 5 + [0.8] * 10 + [0.1] * 5  # a peak from step 5; its two-step average falls at step 16
        lines = [{"step": s, "reward_mean": r, **({} if ess is None else {"ess": ess[s]})}
                 for s, r in enumerate(rewards)]
        return RunRecord("r", Path("r"), {}, lines)

    early = [1.0] * 10 + [0.2] * 10  # below 0.5 from step 10 (its two-step average from step 11)
    assert instability(run(early)) == ["reward collapsed to 0.100 from a peak of 0.800; its ess fell below 0.5 at "
                                       "step 11, 5 steps before the fall (step 16)"]
    assert instability(run([0.9] * 20))[0].endswith("; its ess stayed above 0.5")
    assert instability(run(None)) == ["reward collapsed to 0.100 from a peak of 0.800"]  # a run without the diagnostic


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
    assert summarize(load_runs(results))[1] == ["math500", "mmlu_college_physics", "zz_custom"]


def test_the_objective_columns_the_reference_row_and_paired_significance(tmp_path):
    """Per-prompt measurements with known gaps: k3-loss is worse than k1-reward by the same amount on
    both seeds (a paired t-test finds it), and the reference's row leads the beta group."""
    import math

    import scipy.stats

    from sweep.report.table import paired_p_value
    from trainer.measure.optimum import optimal_value

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


def test_extra_axes_group_the_rows_go_in_the_columns_and_get_their_figures(tmp_path):
    results = write_offpolicy_study(tmp_path / "results")
    files = {f.split("/")[-1] for f in report(results)["files"]}
    md = (results / "tables" / "results.md").read_text()
    assert md.startswith("| model | beta | kl_loss_ratio | async_level | configuration | seeds | arith | "
                         "objective_gap |")
    assert "| toy | 0.1 | - | 2 | k1-reward | 2 | **0.605 ± 0.007** |" in md  # the reward's KL has no loss ratio
    # k1-loss without the ratio loses 0.2 at async 2 on both seeds against k1-reward there: a paired test finds it
    assert "| toy | 0.1 | none | 2 | k1-loss | 2 | 0.355 ± 0.007* |" in md
    assert "| toy | 0.1 | detached | 2 | k1-loss | 2 | 0.555 ± 0.007* |" in md
    assert "| toy | - | - | 2 | no KL | 2 | 0.300 ± 0.000 |" in md
    assert md.index("| toy | 0.1 | - | - | reference |") < md.index("| toy | 0.1 | - | 0 | k1-reward |")

    by_async = (results / "tables" / "results_by_async_level.md").read_text()
    assert by_async.startswith("| model | beta | kl_loss_ratio | configuration | seeds | arith (async_level=0) | "
                               "arith (async_level=2) |")
    assert "| toy | 0.1 | none | k1-loss | 2 | 0.555 ± 0.007* | 0.355 ± 0.007* |" in by_async
    assert "| toy | 0.1 | detached | k1-loss | 2 | 0.555 ± 0.007* | 0.555 ± 0.007* |" in by_async
    reference = next(line for line in by_async.splitlines() if "| reference |" in line)
    assert reference.count("0.000") == 2  # its KL, in both async columns
    assert "results_by_kl_loss_ratio.md" in files and "results_by_async_level.tex" in files

    rows = list(csv.DictReader((results / "tables" / "results.csv").open()))
    assert list(rows[0])[:5] == ["model", "beta", "objective.kl_loss_ratio", "train.async_level", "configuration"]
    detached = next(r for r in rows if r["configuration"] == "k1-loss" and r["objective.kl_loss_ratio"] == "detached"
                    and r["train.async_level"] == "2" and r["task"] == "objective_gap")
    assert detached["p_vs_k1_reward"] != ""

    assert {"accuracy_vs_async_level_toy.png", "curves_toy_beta0.1_ratio-detached_async2.png",
            "curves_toy_beta0.1_ratio-none_async0.png", "reward_vs_kl_toy_ratio-detached_async2.png"} <= files
    assert not any(f.startswith("accuracy_vs_beta") for f in files)  # one beta
    figure = results / "figures" / "accuracy_vs_async_level_toy.png"
    assert figure.read_bytes().startswith(b"\x89PNG") and figure.stat().st_size > 20_000


def test_a_run_whose_config_predates_an_axis_sits_at_the_trainers_default_not_at_every_value(tmp_path):
    """A study grown by a new axis (objective.kl_to) after its first runs: those runs' configs, written by an
    older trainer, lack the key. They ran at its default and are counted there once, not in every column."""
    results = tmp_path / "results"
    for seed in (0, 1):
        write_run(results, f"toy__k1-loss__b0.1__s{seed}", "k1", "loss", 0.1, seed, [0.5, 0.5], {"arith": 0.2})
        write_run(results, f"toy__k1-loss__b0.1__kl_to-both__s{seed}", "k1", "loss", 0.1, seed, [0.5, 0.6],
                  {"arith": 0.6}, objective={"kl_to": "both", "behaviour_beta": 0.1})
    write_run(results, "toy__k1-loss__b0.1__s2", "k1", "loss", 0.1, 2, [0.5, 0.5], {"arith": 0.2},
              objective={"kl_to": "reference"})  # the same point, trained after the key existed
    records = load_runs(results)
    assert {r.run_id: r.coords["objective.kl_to"] for r in records if r.run_id.endswith("s0")} == {
        "toy__k1-loss__b0.1__s0": "reference", "toy__k1-loss__b0.1__kl_to-both__s0": "both"}
    report(results, columns=("objective.kl_to",))
    by_kl_to = (results / "tables" / "results_by_kl_to.md").read_text()
    assert "| toy | 0.1 | k1-loss | 2/3 | 0.600 ± 0.000 | 0.200 ± 0.000 |" in by_kl_to


def test_a_report_removes_what_the_one_before_wrote_and_it_no_longer_writes(tmp_path):
    """Grown by an axis, a study's figures take new names: the old ones, with fewer seeds, must not stay
    beside them as if current. A file the report never wrote stays."""
    results = write_offpolicy_study(tmp_path / "results")
    before = set(report(results)["files"])
    mine = results / "figures" / "my_own_figure.png"
    mine.write_bytes(b"not the report's")
    for seed in (0, 1):
        write_run(results, f"toy__k1-loss__b0.1__kl_to-both__async2__s{seed}", "k1", "loss", 0.1, seed, [0.5, 0.6],
                  {"arith": 0.6}, train={"async_level": 2},
                  objective={"kl_loss_ratio": "none", "kl_to": "both", "behaviour_beta": 0.1},
                  measured=([0.7, 0.4], [0.2, 0.2]))
    after = set(report(results)["files"])
    gone = before - after
    assert str(results / "figures" / "curves_toy_beta0.1_ratio-none_async2.png") in gone
    assert str(results / "figures" / "curves_toy_beta0.1_kl_to-reference_ratio-none_async2.png") in after
    assert not any(Path(name).exists() for name in gone) and all(Path(name).exists() for name in after)
    assert mine.read_bytes() == b"not the report's"


def test_any_axis_in_the_columns_and_a_bad_one_named(tmp_path):
    results = write_offpolicy_study(tmp_path / "results")
    report(results, columns=("placement",))
    by_placement = (results / "tables" / "results_by_placement.md").read_text()
    assert "| toy | 0.1 | none | 2 | k1 | 2 | **0.605 ± 0.007** | 0.355 ± 0.007* |" in by_placement  # reward: no ratio
    with pytest.raises(ValueError, match="--columns: 'seed' is not an axis of these runs"):
        report(results, columns=("seed",))


def test_the_report_styles_every_registered_choice_and_any_other_name():
    from sweep.report import styles
    from trainer.objective import estimators, placements

    assert set(styles.ESTIMATORS) == set(estimators.REGISTRY.names)
    assert set(styles.PLACEMENT_FILLS) == set(placements.kl_placements())
    assert (styles.estimator_color("k1"), styles.estimator_marker("k1")) == ("tab:blue", "o")
    plugin = (styles.estimator_color("my-k4"), styles.estimator_marker("my-k4"))
    assert plugin in styles.SPARE_ESTIMATORS and plugin == (styles.estimator_color("my-k4"),
                                                           styles.estimator_marker("my-k4"))
    assert styles.placement_fill("my-placement") == styles.DEFAULT_FILL
