"""Each library's default as a preset: in run configs, as a study axis, in reports; the presets study."""

from pathlib import Path

import pytest
import yaml

from sweep.report.table import Cell, Group, _mark_significance
from sweep.study import axes
from sweep.study.grid import StudyError, load_study
from trainer import config as run_config
from trainer.objective import presets
from trainer.objective.objective_config import ObjectiveConfig

REPO = Path(__file__).resolve().parent.parent


def study(**grid) -> dict:
    config = yaml.safe_load((REPO / "workflow" / "config" / "toy_peers.yaml").read_text())
    config["grid"] = {**config["grid"], **grid}
    return config


def test_every_preset_is_a_valid_objective_that_cites_where_it_was_read():
    for preset in presets.REGISTRY:
        objective = ObjectiveConfig.of_preset(preset.name)
        assert objective.preset == preset.name
        assert all(getattr(objective, key) == value for key, value in preset.values.items())
        assert len(preset.source.commit) == 40 and preset.source.files and preset.settings
    assert {p.library for p in presets.REGISTRY} == {"verl", "OpenRLHF", "TRL GRPOTrainer", "TRL RLOOTrainer",
                                                     "NeMo-RL", "slime", "SkyRL", "open-instruct",
                                                     "A Comedy of Estimators", "prime-rl"}


def test_a_run_config_takes_a_presets_values_under_the_keys_it_gives():
    config = run_config.load(None, ["model.path=m", "objective.preset=verl", "objective.beta=0.2"])
    assert (config.objective.estimator, config.objective.placement, config.objective.beta) == ("k3", "loss", 0.2)
    assert (config.objective.kl_log_ratio_clamp, config.objective.kl_value_clamp) == (20.0, 10.0)
    again = run_config.from_dict(config.to_dict())  # a saved config.yaml reads back the same
    assert again == config
    with pytest.raises(run_config.ConfigError, match=r"^objective.preset: 'verl2' is not one of verl, verl-k3\+"):
        run_config.load(None, ["model.path=m", "objective.preset=verl2"])
    with pytest.raises(run_config.ConfigError, match=r"^objective.ref_refresh_every: must be None or an integer"):
        run_config.load(None, ["model.path=m", "objective.preset=slime", "objective.ref_refresh_every=0"])


def test_the_papers_presets_take_mu_from_the_trainer_unless_the_run_config_says_otherwise():
    """The Comedy paper's fork recomputes the behaviour log-probs with the trainer (recompute_logprobs): a paper-*
    preset sets rollout.recompute_logprobs where the run config does not; the others leave the run's default."""
    paper = run_config.load(None, ["model.path=m", "objective.preset=paper-icepop"])
    assert paper.rollout.recompute_logprobs and run_config.from_dict(paper.to_dict()) == paper
    engine = run_config.load(None, ["model.path=m", "objective.preset=paper-icepop",
                                    "rollout.recompute_logprobs=false"])
    assert not engine.rollout.recompute_logprobs
    assert not run_config.load(None, ["model.path=m", "objective.preset=verl"]).rollout.recompute_logprobs
    # and the libraries whose anchor is the trainer's pi_old: verl's DPPO, OpenRLHF's unbiased_gradient
    assert {name for name in presets.NAMES if presets.REGISTRY[name].rollout} == {
        name for name in presets.NAMES if name.startswith("paper-")} | {"verl-dppo-tv", "verl-dppo-kl",
                                                                          "openrlhf-unbiased"}


def test_presets_as_a_study_axis_set_each_runs_estimator_and_placement():
    config = study(seeds=[0])
    runs = {run.run_id: run for run in load_study(config).runs}
    assert len(runs) == len(config["grid"]["axes"]["objective.preset"]) + 1  # each preset, and the baseline once
    verl = runs["toy-sft__k3-loss__b0.1__preset-verl__s0"]
    assert verl.config["objective"] == {"advantage": "rloo", "placement": "loss", "estimator": "k3", "beta": 0.1,
                                        "preset": "verl"}
    assert verl.coords["objective.preset"] == "verl"
    assert "toy-sft__k1-reward-to-go__b0.1__preset-openrlhf__s0" in runs
    assert "toy-sft__none__preset-slime-grpo-reward-kl__s0" in runs  # slime's GRPO drops its reward KL
    assert runs["toy-sft__none__s0"].coords["objective.preset"] is None


@pytest.mark.parametrize("grid,message", [
    ({"estimators": ["k1"]}, "grid.estimators: objective.preset is an axis and sets each run's estimator"),
    ({"axes": {"objective.preset": ["verl", "trl"]}}, "grid.axes.objective.preset[1]: 'trl' is not one of verl,"),
])
def test_a_bad_presets_grid_names_the_key(grid, message):
    with pytest.raises(StudyError) as error:
        load_study(study(**grid))
    assert str(error.value).startswith(message)


def test_the_presets_study_builds_on_the_toy_study():
    """Moving the presets study to another toy is copying toy.yaml's sections: they must agree."""
    toy = yaml.safe_load((REPO / "workflow" / "config" / "toy.yaml").read_text())
    peers = yaml.safe_load((REPO / "workflow" / "config" / "toy_peers.yaml").read_text())
    for section in ("models", "run", "data", "evaluate"):
        assert peers[section] == toy[section], f"toy_peers.yaml's {section} must be toy.yaml's"


def test_a_key_a_preset_sets_is_no_axis_of_its_own():
    configs = [{"model": {"path": "m"}, "objective": ObjectiveConfig.of_preset(name, beta=1.0).__dict__}
               for name in ("verl", "nemo-rl", "trl-rloo")]
    assert axes.extra_axes(configs) == ["objective.preset"]  # not kl_loss_ratio, the clamps, ...
    completed = [run_config.from_dict({"model": {"path": "m"}, "objective": {"preset": name}}).to_dict()
                 for name in ("verl", "paper-k1-reward")]
    assert axes.extra_axes(completed) == ["objective.preset"]  # nor the paper's rollout.recompute_logprobs


def test_presets_are_tested_against_k1_reward_whichever_preset_computes_it():
    def group(preset, estimator, placement, values):
        coords = {"model": "m", "estimator": estimator, "placement": placement, "beta": 1.0,
                  "objective.preset": preset}
        return Group(coords, f"{estimator}-{placement}", {"objective_gap": Cell(dict(enumerate(values)))}, seeds=3)

    groups = {"a": group("trl-rloo", "k1", "reward", [0.10, 0.11, 0.12]),
              "b": group("verl", "k3", "loss", [0.30, 0.32, 0.31])}
    _mark_significance(groups)
    assert groups["b"].cells["objective_gap"].significant
