"""A training run's config and directory, without training: bad configs and data stop `python -m trainer train`
(and `train-runs`) before any model loads with one clear message; config files, overrides and a config.yaml
written before a key existed; a torn metrics line. No model is loaded here (the model directory is only named),
so these tests are in the fast tier; tests/test_train.py trains."""

import json
import subprocess
import sys

import pytest
from run_helpers import metrics, overrides, trainer_in_process

from trainer import config as run_config
from trainer.run import directory

BAD_CONFIGS = [
    ("objective.estimator=k4", "objective.estimator: 'k4' is not one of k1, k2, k3"),
    ("objective.placement=everywhere", "objective.placement: 'everywhere' is not one of"),
    ("objective.advantage=ppo", "objective.advantage: 'ppo' is not one of"),
    ("objective.beta=-0.1", "objective.beta: must be a finite number >= 0"),
    ("train.group_size=1", "train.group_size: advantage rloo needs group_size >= 2"),
    ("model.path=/no/such/model", "model.path: model path /no/such/model does not exist"),
    ("train.lerning_rate=0.1", "train.lerning_rate: unknown key"),
    ("task.name=math", "task.options: "),
]


@pytest.mark.parametrize("override,message", BAD_CONFIGS)
def test_bad_configs_fail_before_any_model_loads_with_one_clear_message(warm_model, tmp_path, override, message):
    """The command's main() in this process: the same exit status, message and files as the command's
    (the next test runs the command itself)."""
    result = trainer_in_process("train", "--out", str(tmp_path / "bad"), *overrides(warm_model), override)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.parametrize("override,message", [BAD_CONFIGS[0], BAD_CONFIGS[5]], ids=["config", "model-path"])
def test_a_bad_config_stops_the_train_command_itself(warm_model, tmp_path, override, message):
    """`python -m trainer train` as a process: the message reaches its stderr and it exits with 2 (a
    config error, and an error found only by train() before loading)."""
    result = subprocess.run([sys.executable, "-m", "trainer", "train", "--out", str(tmp_path / "bad"),
                             *overrides(warm_model), override], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_empty_data_set_is_a_clear_error(warm_model, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = trainer_in_process("train", "--out", str(tmp_path / "run"), *overrides(warm_model), "task.name=math",
                                f"task.options={{path: {empty}}}")
    assert result.returncode == 2 and "has no records" in result.stderr and "Traceback" not in result.stderr


def test_a_bad_config_anywhere_in_a_plan_stops_train_runs_before_any_run_starts(warm_model, tmp_path):
    short = {"train.steps": 2, "checkpoint.every": 1}
    bad = {str(tmp_path / "c"): overrides(warm_model, **short), str(tmp_path / "d"): ["train.stepz=2"]}
    refused = trainer_in_process("train-runs", "--plan", json.dumps(bad))
    assert refused.returncode == 2 and "d: train.stepz: unknown key" in refused.stderr
    assert not (tmp_path / "c").exists()


def test_config_file_with_overrides_and_yaml_floats(tmp_path, warm_model):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {warm_model}}}\ntrain: {{lr: 1e-4, steps: 3}}\nobjective: {{beta: 1e-3}}\n")
    config = run_config.load(path, ["train.steps=5"])
    assert config.train.lr == 1e-4 and config.objective.beta == 1e-3 and config.train.steps == 5
    with pytest.raises(run_config.ConfigError, match="--config: no such file"):
        run_config.load(tmp_path / "absent.yaml")


def test_resume_drops_a_torn_metrics_line(tmp_path):
    """A run killed in the middle of writing metrics.jsonl leaves a partial last line."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n" + json.dumps({"step": 1}) + "\n"
                                            + '{"step": 2, "rew')
    directory.truncate_metrics(tmp_path, 1)
    assert metrics(tmp_path) == [{"step": 0}]


def test_a_run_started_before_a_config_key_existed_still_resumes(warm_model, tmp_path):
    """config.yaml of a run started by an older klstudy lacks the keys added since: at their
    defaults they are no change; set otherwise, they are."""
    import yaml

    config = run_config.load(None, overrides(warm_model))
    saved = config.to_dict()
    del saved["rollout"]["vllm_cpu_kvcache_gib"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    directory.check_or_write_config(tmp_path, config)
    changed = run_config.load(None, overrides(warm_model, **{"rollout.vllm_cpu_kvcache_gib": 2}))
    with pytest.raises(run_config.ConfigError, match=r"different config \(rollout.vllm_cpu_kvcache_gib\)"):
        directory.check_or_write_config(tmp_path, changed)


def test_a_config_error_carries_its_key_as_data_and_crosses_processes():
    """The key is data (a study blames the key that set it from `error.key`); the error pickles whole, as
    the processes of a run pass it to each other (trainer.run.directory.claim), subclass included."""
    import pickle

    with pytest.raises(run_config.ConfigError) as caught:
        run_config.from_dict({"model": {"path": "m"}, "objective": {"kl_target": 0.1}})
    error = caught.value
    assert (error.key, str(error)) == ("objective.kl_horizon", f"objective.kl_horizon: {error.message}")
    assert str(error.at("--run a.yaml out")) == f"--run a.yaml out: objective.kl_horizon: {error.message}"
    taken = pickle.loads(pickle.dumps(directory.DirectoryTaken("--out x", "holds another run")))
    assert type(taken) is directory.DirectoryTaken and (taken.key, taken.message) == ("--out x", "holds another run")


def test_every_declared_bound_and_choice_refuses_a_value_outside_it_by_its_key():
    """The bounds and choices sit beside the fields (trainer.config's `bounded`, `chosen`), not in an if-chain:
    each one, given a value outside it, is the error, keyed by its field."""
    import dataclasses

    outside = {">= 0": -1, ">= 1": 0, "> 0": 0, "in (0, 1]": 1.5}
    declared = 0
    for section in dataclasses.fields(run_config.RunConfig):
        for spec in dataclasses.fields(section.default_factory()):
            if not {"bound", "choices"} & set(spec.metadata):
                continue
            declared += 1
            key = f"{section.name}.{spec.name}"
            bad = outside[spec.metadata["bound"]] if "bound" in spec.metadata else "none-such"
            with pytest.raises(run_config.ConfigError) as caught:
                run_config.from_dict({"model": {"path": "m"}, section.name: {spec.name: bad}})
            assert caught.value.key == key, str(caught.value)
    assert declared >= 30  # the graph of fields was read
    with pytest.raises(run_config.ConfigError, match=r"^train.lr: must be > 0, got nan$"):
        run_config.from_dict({"model": {"path": "m"}, "train": {"lr": float("nan")}})
