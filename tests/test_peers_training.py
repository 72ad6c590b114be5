"""The peers' settings in the trainer: per-token KL rewards, the engine weight, clamps, the entropy bonus, an
adaptive beta and a refreshed reference in one run, which resumes bit for bit."""

import shutil

import torch
from run_helpers import metrics, objective, train_cli
from safetensors.torch import load_file

from trainer.run import COMPLETE, TIMING_KEYS

MOVING = {"objective.estimator": "k3", "objective.placement": "reward-to-go+loss", "objective.beta": 0.1,
          "objective.kl_loss_ratio": "engine", "objective.kl_log_ratio_clamp": 20, "objective.kl_value_clamp": 10,
          "objective.entropy_coef": 0.01, "objective.kl_target": 0.001, "objective.kl_horizon": 100,
          "objective.ref_refresh_every": 2, "objective.ref_refresh_alpha": 0.6, "train.steps": 6,
          "checkpoint.every": 1, "checkpoint.keep": 10, "measure.prompts": 4, "measure.samples": 2,
          "measure.reference_samples": 4, "measure.every": 3, "measure.task_options": "{seed: 1}"}


def _comparable(lines):
    return [{k: v for k, v in m.items() if k not in (*TIMING_KEYS, "measure_time")} for m in lines]


def test_adaptive_beta_and_a_refreshed_reference_resume_exactly(warm_model, tmp_path):
    straight = tmp_path / "straight"
    result = train_cli(straight, warm_model, **MOVING)
    assert result.returncode == 0, result.stderr
    lines = metrics(straight)
    betas = [m["kl_coef"] for m in lines]
    assert betas[0] == 0.1 and len(set(betas)) == len(betas)  # the controller moves beta every step
    assert all(m["loss_entropy"] < 0 and m["entropy"] > 0 for m in lines)
    measured = objective(straight)
    assert [m["step"] for m in measured] == [3, 6]
    assert measured[0]["beta"] == betas[3]  # measured after 3 updates: at the beta of the 4th step
    assert measured[1]["beta"] not in betas  # after the last update: the final beta
    # the reference moved (every 2 steps): it is part of the run's state
    state = torch.load(straight / "checkpoints" / "step_6" / "trainer_state.pt", weights_only=False)
    initial = load_file(warm_model / "model.safetensors")
    name = next(k for k in state["reference"] if k in initial and initial[k].is_floating_point())
    assert not torch.equal(state["reference"][name], initial[name])
    assert state["kl_coefficient"]["value"] == measured[1]["beta"]

    resumed = tmp_path / "resumed"  # as if killed after step 3's checkpoint
    shutil.copytree(straight, resumed)
    for step in (4, 5, 6):
        shutil.rmtree(resumed / "checkpoints" / f"step_{step}")
    shutil.rmtree(resumed / "final")
    (resumed / COMPLETE).unlink()
    again = train_cli(resumed, warm_model, **MOVING)
    assert again.returncode == 0, again.stderr
    assert "resumed from checkpoint step_3" in again.stderr
    assert _comparable(metrics(resumed)) == _comparable(lines)
    assert _comparable(objective(resumed)) == _comparable(measured)
    a, b = load_file(resumed / "final" / "model.safetensors"), load_file(straight / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
