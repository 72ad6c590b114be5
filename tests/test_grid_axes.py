"""Any run-config key as a study axis: expansion, run ids that never change, include/exclude, errors; and an
override file that regroups a study's runs into jobs without changing their ids (smol_mps.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from snakemake.utils import update_config

from sweep.study.grid import StudyError, load_study
from trainer import config as run_config

REPO = Path(__file__).resolve().parent.parent
OFF_POLICY_GRID = {"estimators": ["k1", "k3"], "placements": ["reward", "loss"], "betas": [0.1], "seeds": [0],
                   "axes": {"objective.kl_loss_ratio": ["none", "detached"], "train.async_level": [0, 2]}}


def study_config(name: str = "toy", **grid) -> dict:
    config = yaml.safe_load((REPO / "workflow" / "config" / f"{name}.yaml").read_text())
    if grid:
        config["grid"] = grid
    return config


def test_the_paper_studys_333_run_ids_are_unchanged():
    """A sweep started before axes existed resumes without rerunning anything."""
    expected = (REPO / "tests" / "data" / "paper_run_ids.txt").read_text().split()
    assert [run.run_id for run in load_study(study_config("paper")).runs] == expected
    assert len(expected) == 333


def test_axes_multiply_and_a_point_runs_once_whatever_the_values_it_does_not_use():
    """2 estimators x 2 placements x 2 ratios x 2 async levels is 16 points, but the KL in the reward
    has no KL loss term, so its ratio changes nothing: 12 runs; the baseline crosses the async level
    (it still means something without KL) but not the ratio: 2 more."""
    study = load_study(study_config(**OFF_POLICY_GRID))
    runs = {run.run_id: run for run in study.runs}
    assert len(runs) == 14
    assert list(runs)[:6] == ["toy-sft__k1-reward__b0.1__s0", "toy-sft__k1-reward__b0.1__async2__s0",
                              "toy-sft__k1-loss__b0.1__s0", "toy-sft__k1-loss__b0.1__async2__s0",
                              "toy-sft__k1-loss__b0.1__ratio-detached__s0",
                              "toy-sft__k1-loss__b0.1__ratio-detached__async2__s0"]
    assert [i for i in runs if "none" in i] == ["toy-sft__none__s0", "toy-sft__none__async2__s0"]
    detached = runs["toy-sft__k3-loss__b0.1__ratio-detached__async2__s0"]
    assert detached.config["objective"]["kl_loss_ratio"] == "detached" and detached.config["train"]["async_level"] == 2
    assert detached.coords == {"model": "toy-sft", "estimator": "k3", "placement": "loss", "beta": 0.1,
                               "objective.kl_loss_ratio": "detached", "train.async_level": 2, "seed": 0}
    base = runs["toy-sft__k3-loss__b0.1__s0"]
    assert "kl_loss_ratio" not in base.config["objective"] and "async_level" not in base.config["train"]
    assert base.coords["objective.kl_loss_ratio"] == "none" and base.coords["train.async_level"] == 0
    assert runs["toy-sft__k1-reward__b0.1__s0"].coords["objective.kl_loss_ratio"] is None  # unused: no coordinate
    assert runs["toy-sft__none__async2__s0"].coords == {
        "model": "toy-sft", "estimator": None, "placement": "none", "beta": None, "objective.kl_loss_ratio": None,
        "train.async_level": 2, "seed": 0}


def test_adding_an_axis_or_a_value_renames_no_run():
    """An extra axis shows in an id only away from the base value (the study's `run`, else the trainer's
    default): the toy study's 30 ids survive an axis through the base value, and a second value of it."""
    before = [run.run_id for run in load_study(study_config()).runs]
    config = study_config()
    config["grid"]["axes"] = {"train.async_level": [0, 1], "train.lr": [1e-3, "3e-4"]}  # the run's lr is 1e-3
    after = [run.run_id for run in load_study(config).runs]
    assert set(before) <= set(after) and len(after) == 4 * len(before)
    assert "toy-sft__k2-loss__b0.1__async1__lr0.0003__s2" not in after  # ids follow the run config's order
    assert "toy-sft__k2-loss__b0.1__lr0.0003__async1__s2" in after
    assert load_study(config).run("toy-sft__none__lr0.0003__s0").config["train"]["lr"] == 3e-4  # "3e-4" read as a float


def test_include_and_exclude_take_axis_keys():
    config = study_config(**OFF_POLICY_GRID)
    config["grid"]["exclude"] = [{"train.async_level": 2, "placement": "loss"}]
    config["grid"]["include"] = [{"estimator": "k2", "placement": "loss", "beta": 0.1,
                                  "objective.kl_loss_ratio": ["differentiable", "none"], "train.lr": 3e-4}]
    runs = {run.run_id: run for run in load_study(config).runs}
    assert not any("loss" in i and "async2" in i for i in runs)
    assert "toy-sft__k1-reward__b0.1__async2__s0" in runs and "toy-sft__none__async2__s0" in runs
    assert {"toy-sft__k2-loss__b0.1__ratio-differentiable__lr0.0003__s0",
            "toy-sft__k2-loss__b0.1__lr0.0003__s0"} <= set(runs)
    included = runs["toy-sft__k2-loss__b0.1__lr0.0003__s0"]
    assert included.coords["train.lr"] == 3e-4 and runs["toy-sft__k1-loss__b0.1__s0"].coords["train.lr"] == 1e-3


@pytest.mark.parametrize("axes, message", [
    ({"lr": [1]}, "grid.axes.lr: an axis is a dotted run-config key such as train.async_level"),
    ({"trian.lr": [1]}, "grid.axes.trian.lr: no run-config section 'trian'"),
    ({"train.lrr": [1]}, "grid.axes.train.lrr: train has no key 'lrr'"),
    ({"train.lr.high": [1]}, "grid.axes.train.lr.high: train.lr is a value, not a mapping"),
    ({"objective.beta": [1]}, "grid.axes.objective.beta: an axis of its own: grid.betas"),
    ({"model.path": ["x"]}, "grid.axes.model.path: set from `models`"),
    ({"train.async_level": []}, "grid.axes.train.async_level: at least one value"),
    ({"train.async_level": [0, -1]}, "grid.axes.train.async_level[1]: must be >= 0, got -1"),
    ({"train.async_level": [2, 2]}, "grid.axes.train.async_level[1]: 2 is listed twice"),
    ({"objective.kl_loss_ratio": ["sometimes"]},
     "grid.axes.objective.kl_loss_ratio[0]: 'sometimes' is not one of none, detached, differentiable"),
    ({"objective.clip_eps_high": [0.3]}, "grid.axes.objective.clip_eps_high[0]: set clip_eps too"),
    ({"train.steps": ["many"]}, "grid.axes.train.steps[0]: expected int, got 'many'"),
])
def test_bad_axes_name_the_key_and_the_value(axes, message):
    with pytest.raises(StudyError) as error:
        load_study(study_config(**{**OFF_POLICY_GRID, "axes": axes}))
    assert str(error.value).startswith(message), str(error.value)


def test_an_axis_value_bad_only_with_another_axis_names_the_axis():
    """clip_eps_high is fine where clip_eps is set: the combination is checked run by run."""
    axes = {"objective.clip_eps": [None, 0.2], "objective.clip_eps_high": [None, 0.3]}
    with pytest.raises(StudyError, match=r"^grid.axes.objective.clip_eps_high: set clip_eps too .* \(in run "
                       r"toy-sft__k1-reward__b0.1__clip_eps_high-0.3__s0\)"):
        load_study(study_config(**{**OFF_POLICY_GRID, "axes": axes}))
    axes["objective.clip_eps"] = [0.2]
    ids = [run.run_id for run in load_study(study_config(**{**OFF_POLICY_GRID, "axes": axes})).runs]
    assert "toy-sft__k1-loss__b0.1__clip0.2__clip_eps_high-0.3__s0" in ids


def test_bad_include_and_exclude_axis_keys_name_the_entry():
    config = study_config(**OFF_POLICY_GRID)
    config["grid"]["exclude"] = [{"train.asink": 2}]
    with pytest.raises(StudyError, match=r"^grid.exclude\[0\].train.asink: train has no key 'asink'"):
        load_study(config)
    config["grid"]["exclude"] = []
    config["grid"]["include"] = [{"placement": "none", "train.async_level": -3}]
    with pytest.raises(StudyError, match=r"^grid.include\[0\].train.async_level\[0\]: must be >= 0"):
        load_study(config)


def test_the_off_policy_studies_grids():
    """toy_offpolicy: the Comedy paper's seven off-policy objectives (presets paper-*) x async 0, 10, but IcePop
    on-policy (where it is paper-grpo bit for bit), 3 seeds; paper_offpolicy: the seven on both of the paper's
    models, each with its task and steps, at async level 10."""
    toy = [run.run_id for run in load_study(study_config("toy_offpolicy")).runs]
    assert len(toy) == (7 * 2 - 1) * 3 and len([i for i in toy if i.endswith("__s0")]) == 13
    assert "toy-sft__k1-reward-centred__b0.1__preset-paper-k1-reward__async10__s2" in toy
    assert "toy-sft__none__preset-paper-grpo__async10__s1" in toy and "toy-sft__none__preset-paper-grpo__s1" in toy
    assert not any("paper-icepop" in i and "async10" not in i for i in toy)
    runs = load_study(study_config("paper_offpolicy")).runs
    assert len(runs) == 2 * 7 and {run.config["train"]["async_level"] for run in runs} == {10}
    steps = {run.run_id.split("__")[0]: (run.config["task"]["name"], run.config["train"]["steps"]) for run in runs}
    assert steps == {"Qwen2.5-7B": ("math", 420), "Qwen3-4B-Instruct-2507": ("countdown", 520)}
    assert "Qwen2.5-7B__k1-reward-centred__b0.005__preset-paper-k1-reward-reset50__s0" in [r.run_id for r in runs]
    # as the fork, mu's log-probs are the trainer's (the presets' rollout.recompute_logprobs)
    for study in ("toy_offpolicy", "paper_offpolicy"):
        assert all(run_config.from_dict(run.config).rollout.recompute_logprobs
                   for run in load_study(study_config(study)).runs)


def test_the_mps_variant_keeps_smols_run_ids_and_makes_eight_training_jobs_of_bf16_runs():
    """workflow/config/smol_mps.yaml over smol.yaml: the same 30 run ids, in 8 training jobs that a
    16-core node runs at once (2 CPUs each), bf16 mixed precision, results apart from smol.yaml's."""
    def merged(*names):
        data: dict = {}
        for name in names:
            update_config(data, yaml.safe_load((REPO / "workflow" / "config" / name).read_text()))
        return load_study(data)

    smol, mps = merged("smol.yaml"), merged("smol.yaml", "smol_mps.yaml")
    assert [run.run_id for run in mps.runs] == [run.run_id for run in smol.runs] and len(mps.runs) == 30
    jobs = mps.bundles("train", [run.run_id for run in mps.runs])
    assert sorted(map(len, jobs)) == [2, 4, 4, 4, 4, 4, 4, 4] and mps.resources_for("train", None)["cpus"] == 2
    assert {run.config["train"]["mixed_precision"] for run in mps.runs} == {"bf16"}
    assert mps.results != smol.results
