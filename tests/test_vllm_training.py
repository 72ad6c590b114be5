"""Training with rollouts from vLLM (its CPU build here; CI requires it): rollouts a step ahead of
the policy, SIGKILL, resume. Each run starts its own engine, so this is one run and its resumption."""

import pytest
from rounding import assert_same_statistic, logprob_rounding, statistic_rounding
from run_helpers import TOY_RUN, kill_cli, metrics, objective, start_cli, train_cli, wait_for_lines
from vllm_required import require_vllm

from trainer.model.models import load_model
from trainer.run import COMPLETE

VLLM_RUN = {"rollout.engine": "vllm", "train.async_level": 1, "train.steps": 6, "checkpoint.every": 1,
            "objective.tis_cap": 2.0, "measure.prompts": 4, "measure.samples": 4, "measure.reference_samples": 4,
            "measure.every": 3}


@pytest.mark.slow
def test_a_vllm_run_a_step_ahead_survives_sigkill_and_resumes(warm_model, tmp_path):
    require_vllm()
    out = tmp_path / "vllm"
    process = start_cli(out, warm_model, **VLLM_RUN)
    wait_for_lines(out, 3, process, timeout=600)
    kill_cli(process, out)
    assert not (out / COMPLETE).exists()
    resumed = train_cli(out, warm_model, timeout=900, **VLLM_RUN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint" in resumed.stderr and "vLLM 0.32.0 on the cpu" in resumed.stderr
    lines = metrics(out)
    assert [m["step"] for m in lines] == list(range(6))
    # async_level 1: step s trains on the rollouts of the policy of step s - 1 (the first two on step 0's)
    assert [m["policy_step"] for m in lines] == [0, 0, 1, 2, 3, 4]
    lp = max(logprob_rounding(load_model(str(path))) for path in (warm_model, out / "final"))
    for m in lines:  # vLLM samples from the trainer's weights, synced every step, in float32: rounding apart
        assert m["mismatch_logp_max"] <= lp and m["mismatch_kl"] <= lp**2, m  # (k3 of d is about d^2 / 2)
        assert m["tis_weight_mean"] == pytest.approx(1.0, abs=lp)
    assert sum(m["reward_mean"] for m in lines) / len(lines) > 0.1  # vLLM's texts reach the verifier and score
    assert (out / COMPLETE).exists()
    measured = objective(out)  # the objective measured with vLLM's samples, across the kill
    assert [m["step"] for m in measured] == [3, 6] and all(k >= 0 for m in measured for k in m["per_prompt"]["kl"])


@pytest.mark.slow
def test_two_processes_each_with_its_engine_make_the_run_of_one(warm_model, tmp_path):
    """accelerate launch, two CPU processes (gloo, FSDP2), a vLLM engine in each in its external-launcher
    mode: the same samples and updates as one process, and a clean exit (vLLM's process groups are
    torn down before the trainer's)."""
    require_vllm()
    extra = {"rollout.engine": "vllm", "train.steps": 3, "train.prompts_per_step": 8, "checkpoint.every": 1}
    one = train_cli(tmp_path / "one", warm_model, 1, 900, **extra)
    two = train_cli(tmp_path / "two", warm_model, 2, 900, **extra)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert "Traceback" not in two.stderr and two.stderr.count("vLLM 0.32.0 on the cpu") == 2
    floor = statistic_rounding(load_model(str(warm_model)), {**TOY_RUN, **extra})
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        for key in ("reward_mean", "generated_tokens", "loss", "kl_k3"):
            assert_same_statistic(f"step {a['step']}: {key}", a[key], b[key], 1e-4, floor)
