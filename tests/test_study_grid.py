"""The study's grid without Snakemake (sweep.study.grid, sweep.study.jobs): run ids, the baseline, include and exclude,
bundles, bad study configs naming their key, the SmolLM2 study's grid. tests/test_workflow.py and
tests/test_smollm2_study.py run the studies themselves."""

from __future__ import annotations

import pytest
import yaml
from test_smollm2_study import CONFIGS, RUNS
from test_workflow import toy_config

from sweep.study import jobs
from sweep.study.checks import merge
from sweep.study.grid import StudyError, load_study, run_id, spec_digest
from sweep.study.study_check import preflight


def test_grid_deduplicates_the_baseline_and_names_runs_stably():
    config_without_steps = toy_config()
    study = load_study(toy_config())
    ids = [r.run_id for r in study.runs]
    assert len(ids) == 9 * 1 * 3 + 3 and len(set(ids)) == len(ids)  # one baseline per seed
    assert "toy-sft__k3-reward+loss__b0.1__s1" in ids and "toy-sft__none__s0" in ids
    none = study.run("toy-sft__none__s0")
    assert none.config["objective"] == {"advantage": "rloo", "placement": "none"}
    k3 = study.run("toy-sft__k3-loss__b0.1__s1")
    assert k3.config["objective"] == {"advantage": "rloo", "placement": "loss", "estimator": "k3", "beta": 0.1}
    two_betas = toy_config()
    two_betas["grid"]["betas"] = [0.1, 1.0]
    ids = [r.run_id for r in load_study(two_betas).runs]
    assert len(ids) == 9 * 2 * 3 + 3 and len(set(ids)) == len(ids)  # one baseline per seed, not per beta
    assert k3.config["train"]["seed"] == 1 and k3.config["model"] == {"path": str(study.model_dir("toy-sft")),
                                                                       "name": "toy-sft"}
    made_by = spec_digest({"build": study.models["toy-sft"].build, "gguf": None})
    assert study.model_dir("toy-sft").name == f"toy-sft.{made_by}"  # named by how it is made
    other = toy_config()
    other["models"]["toy-sft"]["build"]["sft"]["steps"] = 60
    assert load_study(other).model_dir("toy-sft") != study.model_dir("toy-sft")  # another warm-up, another model
    assert run_id("m", "k1", "reward", 1.0, 0) == "m__k1-reward__b1__s0"  # 1.0 and 1 name the same run
    del config_without_steps["run"]["train"]["steps"]
    config_without_steps["run"]["checkpoint"]["every"] = 10
    study = load_study({**config_without_steps, "evaluate": {**config_without_steps["evaluate"], "every": 10}})
    assert study.eval_steps("toy-sft__none__s0") == [10]  # train.steps defaults to 20
    assert study.run("toy-sft__none__s0").config["measure"]["every"] == 10  # evaluated checkpoints are measured


def test_grid_include_and_exclude():
    config = toy_config()
    config["grid"]["betas"] = [0.1, 1.0]
    config["grid"].update(exclude=[{"placement": "reward+loss"}, {"estimator": "k2", "beta": 1.0}],
                          include=[{"estimator": "k2", "placement": "reward", "beta": [1.0, 2], "seed": 7}])
    ids = [r.run_id for r in load_study(config).runs]
    assert not any("reward+loss" in i for i in ids)
    assert "toy-sft__k2-loss__b1__s0" not in ids and "toy-sft__k2-loss__b0.1__s0" in ids
    assert "toy-sft__k2-reward__b2__s7" in ids and "toy-sft__k2-reward__b1__s7" not in ids  # excluded again


def test_bundles_chunk_the_grid_in_order_and_never_mix_models(tmp_path):
    config = toy_config()
    config["grid"]["betas"] = [0.1, 1.0]
    config["models"]["other"] = {"path": "some/model"}
    study = load_study({**config, "results": str(tmp_path), "bundle": {"train": 8, "evaluate": 1}})
    ids = [r.run_id for r in study.runs]
    work = jobs.plan(study, record=False)
    bundles = [bundle.pending for bundle in work.train_bundles]
    assert sorted(run for bundle in bundles for run in bundle) == sorted(ids)  # every run once
    assert [run for bundle in bundles[:8] for run in bundle] == [i for i in ids if i.startswith("toy-sft")]  # in order
    assert all(len({study.run(r).model for r in bundle}) == 1 for bundle in bundles)
    assert [len(bundle) for bundle in bundles] == [8] * 7 + [1] + [8] * 7 + [1]  # 57 runs per model
    assert work.evaluate_bundles == [] and [t.run for t in work.evaluations] == ids  # a job per evaluation
    with pytest.raises(StudyError, match="bundle.train: must be >= 1"):
        load_study({**config, "bundle": {"train": 0}})
    with pytest.raises(StudyError, match="bundle.report: unknown"):
        load_study({**config, "bundle": {"report": 2}})


@pytest.mark.parametrize("change, key", [
    ({"grid": {"estimators": ["k4"], "betas": [0.1]}}, "grid.estimators[0]"),
    ({"grid": {"betas": [0.1], "sedes": [0]}}, "grid.sedes"),
    ({"run": {"train": {"stepz": 3}}}, "run.train.stepz"),
    ({"run": {"objective": {"loss_agg": "sum"}}}, "run.objective.loss_agg"),
    ({"models": {"toy-sft": {"path": "x", "run": {"train": {"lr": -1}}}}}, "models.toy-sft.run.train.lr"),
    ({"evaluate": {"suites": ["toy"], "data": {}}}, "evaluate.data.arith"),
    ({"evaluate": {"every": 7}}, "evaluate.every"),
    ({"models": {"a__b": {"path": "x"}}}, "models.a__b"),
])
def test_bad_study_configs_name_the_key(change, key):
    config = toy_config()
    for section, value in change.items():
        config[section] = value if section == "models" else {**config.get(section, {}), **value}
    with pytest.raises(StudyError) as error:
        load_study(config)
    assert str(error.value).startswith(key), str(error.value)


def test_each_run_says_which_study_key_set_each_value_and_an_error_names_that_key():
    """RunSpec.sources: the study's `run`, a model's own `run`, the grid's lists and axes, evaluate.every; a
    bad value is blamed on the key that set it, found from the error's key (data), never from its text."""
    config = toy_config()
    config["models"]["toy-sft"]["run"] = {"train": {"lr": 0.002}}
    config["grid"]["axes"] = {"train.async_level": [0, 1]}
    config["evaluate"]["every"] = 25
    study = load_study(config)
    assert study.name == config["study"]
    run = study.run("toy-sft__k3-loss__b0.1__async1__s1")
    assert run.source("train.lr") == "models.toy-sft.run.train.lr"
    assert run.source("train.steps") == "run.train.steps"
    assert run.source("objective.beta") == "grid.betas" and run.source("train.seed") == "grid.seeds"
    assert run.source("train.async_level") == "grid.axes.train.async_level"
    assert run.source("train.adam_betas[1]") == "run.train.adam_betas[1]"  # toy.yaml sets them
    assert run.source("checkpoint.keep_every") == "evaluate.every" and run.source("model.path") == "models.toy-sft"
    assert run.source("train.weight_decay") is None  # the trainer's default
    baseline = study.run("toy-sft__none__async1__s1")
    assert baseline.source("objective.placement") == "grid.baseline" and baseline.source("train.seed") == "grid.seeds"
    assert baseline.source("objective.beta") is None and baseline.source("objective.estimator") is None
    config["grid"]["include"] = [{"estimator": "k2", "placement": "loss", "beta": 0.3, "train.async_level": 1},
                                 {"placement": "none", "seed": 7}]
    included = load_study(config)
    extra = included.run("toy-sft__k2-loss__b0.3__async1__s0")
    assert {extra.source(key) for key in ("objective.estimator", "objective.beta", "train.seed")} == {"grid.include[0]"}
    assert extra.source("train.async_level") == "grid.include[0].train.async_level"
    alone = included.run("toy-sft__none__s7")
    assert alone.source("objective.placement") == "grid.include[1]" and alone.source("objective.beta") is None
    preset = toy_config()
    preset["grid"] = {"betas": [0.1], "seeds": [0], "baseline": False, "axes": {"objective.preset": ["paper-k3-loss"]}}
    [k3] = load_study(preset).runs
    assert k3.source("objective.estimator") == "grid.axes.objective.preset" == k3.source("objective.placement")
    assert k3.source("objective.beta") == "grid.betas"
    axis = toy_config()
    axis["grid"] = {"betas": [0.1], "seeds": [0], "baseline": False, "axes": {"objective.preset": ["paper-icepop"]}}
    axis["run"]["objective"] = {"pg_ratio": "sequence"}  # IcePop's token-ratio bounds have no token ratio
    with pytest.raises(StudyError, match=r"^grid.axes.objective.preset: bounds token ratios, and pg_ratio sequence .*"
                                         r"\(in run toy-sft__.*\)$"):
        load_study(axis)
    model = toy_config()
    model["models"]["toy-sft"]["run"] = {"objective": {"kl_target": 0.1}}  # kl_horizon missing
    with pytest.raises(StudyError, match=r"^run.objective.kl_horizon: the adaptive coefficient needs both"):
        load_study(model)


def test_the_smol_study_is_the_grid_on_one_gpu_and_its_smoke_variant_a_small_cpu_one():
    full = load_study(yaml.safe_load(CONFIGS[0].read_text()))
    assert len(full.runs) == 3 * (9 + 1) and full.bundle == {"train": 10, "evaluate": 10}
    assert full.resources["train"]["gpus"] == 1 and full.models["SmolLM2-135M-Instruct"].gguf
    config = full.runs[0].config
    assert config["model"]["chat_template"] and config["task"]["options"]["prompt"] == "natural"
    smoke = load_study(merge(yaml.safe_load(CONFIGS[0].read_text()), yaml.safe_load(CONFIGS[1].read_text())))
    assert [run.run_id for run in smoke.runs] == RUNS
    assert smoke.resources["train"]["gpus"] == 0 and smoke.runs[0].config["model"]["device"] == "cpu"
    # a GGUF model has no path to check before the prepare step imports it (that check refused the study)
    assert [line for line in preflight(smoke) if "models." in line] == []
