"""End-to-end training: a toy run, resume after SIGKILL, SIGTERM, async rollouts, guards (bad configs and what
needs no training: tests/test_train_config.py)."""

import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rounding import logprob_rounding
from run_helpers import (
    TOY_RUN,
    kill_cli,
    metrics,
    objective,
    overrides,
    start_cli,
    train_cli,
    trainer_in_process,
    wait_for_lines,
)
from safetensors.torch import load_file

from trainer import checkpoint
from trainer import config as run_config
from trainer.model.models import load_model
from trainer.run import COMPLETE, EXIT_PREEMPTED, TIMING_KEYS, Run, SigtermFlag, TrainingError, train
from trainer.run.producer import Producer


def weights(out):
    return load_file(Path(out) / "final" / "model.safetensors")


MEASURE = {"measure.prompts": 8, "measure.samples": 4, "measure.reference_samples": 8, "measure.every": 5,
           "measure.task_options": "{seed: 1}"}
REFERENCE_CHECKPOINTS = {"checkpoint.every": 1, "checkpoint.keep_every": 5, **MEASURE}


@pytest.fixture(scope="module")
def reference_run(warm_model, tmp_path_factory):
    """An uninterrupted 20-step run, checkpointing every step (the comparison for resumed runs)."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    result = train_cli(out, warm_model, **REFERENCE_CHECKPOINTS)
    assert result.returncode == 0, result.stderr
    return out


def test_toy_run_end_to_end(reference_run, warm_model):
    out = reference_run
    lines = metrics(out)
    assert [m["step"] for m in lines] == list(range(20))
    for key in ("reward_mean", "pass_rate", "kl_k1", "kl_k3", "entropy", "response_length", "clip_frac",
                "grad_norm", "tokens_per_s", "step_time", "verifier_timeouts", "policy_step"):
        assert all(key in m and m[key] == m[key] for m in lines), key  # present and not NaN
    assert lines[0]["kl_k3"] == 0.0 and lines[-1]["kl_k3"] > 0  # starts at the reference, then moves
    # one process: the hf engine samples with the trainer's own model, so the mismatch is rounding only
    # (k3 of a log-ratio d is about d^2 / 2)
    lp = max(logprob_rounding(load_model(str(path))) for path in (warm_model, out / "final"))
    assert all(m["mismatch_logp_max"] <= lp and 0 <= m["mismatch_kl"] <= lp**2 for m in lines)
    assert (out / COMPLETE).exists() and (out / "config.yaml").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out / "final") and AutoTokenizer.from_pretrained(out / "final")
    kept = sorted((p.name for p in (out / "checkpoints").iterdir()), key=lambda name: int(name[5:]))
    assert kept == ["step_5", "step_10", "step_15", "step_19", "step_20"]  # keep = 2, keep_every = 5
    kept_model = out / "checkpoints" / "step_10" / "model"  # a complete model directory, for evaluation
    assert AutoModelForCausalLM.from_pretrained(kept_model) and AutoTokenizer.from_pretrained(kept_model)
    measured = objective(out)
    assert [m["step"] for m in measured] == [5, 10, 15, 20]
    for line in measured:
        assert line["prompts"] == 8 and line["samples"] == 4 and len(line["per_prompt"]["kl"]) == 8
        assert all(kl >= 0 for kl in line["per_prompt"]["kl"]) and 0 <= line["reward"] <= 1
        assert line["gap"] == pytest.approx(line["optimum"] - line["reward"] + 0.05 * line["kl"])
    reference = json.loads((out / "objective_reference.json").read_text())
    assert len(reference["histograms"]) == 8 and all(sum(c for _, c in h) == 8 for h in reference["histograms"])
    before = (out / "metrics.jsonl").read_text()
    again = trainer_in_process("train", "--out", str(out), *overrides(warm_model, **REFERENCE_CHECKPOINTS))
    assert again.returncode == 0 and "already complete" in again.stderr
    assert (out / "metrics.jsonl").read_text() == before


def _comparable(lines):
    return [{k: v for k, v in m.items() if k not in (*TIMING_KEYS, "measure_time")} for m in lines]


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(reference_run, warm_model, tmp_path):
    out = tmp_path / "killed"
    kill_after = random.Random(os.getpid()).randint(3, 16)
    process = start_cli(out, warm_model, **{"checkpoint.every": 1, **MEASURE})
    wait_for_lines(out, kill_after, process)
    kill_cli(process, out)
    assert not (out / COMPLETE).exists()
    resumed = train_cli(out, warm_model, **{"checkpoint.every": 1, **MEASURE})
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from checkpoint" in resumed.stderr
    assert _comparable(metrics(out)) == _comparable(metrics(reference_run))
    assert _comparable(objective(out)) == _comparable(objective(reference_run))  # measured again, identically
    a, b = weights(out), weights(reference_run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_checkpoints_and_exits_with_the_preempted_status(warm_model, tmp_path):
    out = tmp_path / "preempted"
    process = start_cli(out, warm_model, **{"checkpoint.every": 100, "train.steps": 200})
    wait_for_lines(out, 3, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == EXIT_PREEMPTED
    steps = len(metrics(out))
    path = out / "checkpoints" / f"step_{steps}"
    assert checkpoint.verify(path) is None  # complete and consistent with its manifest
    result = trainer_in_process("train", "--out", str(out),
                                *overrides(warm_model, **{"checkpoint.every": 100, "train.steps": steps + 2}))
    assert result.returncode != 0 and "different config (train.steps)" in result.stderr  # runs are never mixed


def test_a_sigterm_while_loading_exits_preempted_saying_there_was_no_step_to_checkpoint(warm_model, tmp_path, caplog):
    """SLURM's warning can reach a trainer that is still loading (on the local cluster: 6 s into an attempt):
    it stops before its first step, and says so, rather than that it wrote a checkpoint."""
    class DuringLoading(SigtermFlag):
        checks = 0

        def reached_any(self, world):
            self.checks += 1
            return self.checks > 1  # not before loading; from the loop's first check on

    out = tmp_path / "loading"
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert train(run_config.load(None, overrides(warm_model)), out, DuringLoading()) == EXIT_PREEMPTED
    assert "preempted at step 0; no step to checkpoint yet, exiting with 75" in caplog.text
    assert not list((out / "checkpoints").glob("step_*")) and not metrics(out)


def test_a_partial_or_corrupt_checkpoint_is_skipped(warm_model, tmp_path):
    out = tmp_path / "corrupt"
    process = start_cli(out, warm_model, **{"checkpoint.every": 2, "checkpoint.keep": 5})
    wait_for_lines(out, 7, process)
    kill_cli(process, out)
    newest = max((p for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")),
                 key=lambda p: int(p.name.split("_")[1]))
    with (newest / "trainer_state.pt").open("r+b") as handle:
        handle.truncate(100)
    result = train_cli(out, warm_model, **{"checkpoint.every": 2, "checkpoint.keep": 5})
    assert result.returncode == 0, result.stderr
    assert f"skipping checkpoint {newest}" in result.stderr
    assert [m["step"] for m in metrics(out)] == list(range(20))  # no step lost or repeated


def _weights_hash(model):
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("level", [0, 2])
def test_async_level_trains_step_s_on_rollouts_of_the_policy_of_step_s_minus_k(warm_model, tmp_path, level):
    config = run_config.load(None, overrides(warm_model, **{"train.async_level": level, "train.steps": 6}))
    run = Run(config, tmp_path / f"async{level}")
    generated_with, trained_on, start_of = {}, {}, {}
    generate = run.producer.generate

    def recording_generate(state):
        entry = generate(state)
        generated_with[id(entry.rollouts)] = _weights_hash(run.policy)
        return entry

    run.producer.generate = recording_generate
    for step in range(6):
        start_of[step] = _weights_hash(run.policy)
        head = run.pending[0] if run.pending else None
        metrics_line = run.run_step()
        entry_hash = generated_with[id(head.rollouts)] if head is not None else None
        trained_on[step] = (metrics_line["policy_step"], entry_hash)
    for step in range(6):
        policy_step, entry_hash = trained_on[step]
        assert policy_step == max(0, step - level)
        if entry_hash is not None:
            assert entry_hash == start_of[policy_step]
    assert len({start_of[s] for s in range(6)}) == 6  # the policy really changed every step


def test_non_finite_updates_are_skipped_then_stop_the_run(warm_model, tmp_path, monkeypatch):
    import trainer.run.step as step

    config = run_config.load(None, overrides(warm_model, **{"train.max_nonfinite_updates": 2}))
    run = Run(config, tmp_path / "nan")
    real = step.policy_loss
    monkeypatch.setattr(step, "policy_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    before = _weights_hash(run.policy)
    line = run.run_step()
    assert line["skipped_updates"] == 1 and _weights_hash(run.policy) == before
    with pytest.raises(TrainingError, match="2 non-finite updates in a row at step 1"):
        run.run_step()


@pytest.mark.slow
def test_reward_rises_on_arithmetic(warm_model, tmp_path):
    """A longer run: 64 prompts x 8 samples per step (RL on the toy model needs large batches)."""
    out = tmp_path / "long"
    result = train_cli(out, warm_model, timeout=1200, **{
        "train.steps": 80, "train.prompts_per_step": 64, "train.group_size": 8, "objective.estimator": "k1",
        "objective.placement": "reward", "objective.beta": 0.01, "checkpoint.every": 40})
    assert result.returncode == 0, result.stderr
    rewards = [m["reward_mean"] for m in metrics(out)]
    first, last = sum(rewards[:15]) / 15, sum(rewards[-15:]) / 15
    assert last > first + 0.03, (first, last)


def test_minibatches_and_epochs_make_several_off_policy_updates_per_batch(warm_model, tmp_path, monkeypatch):
    import trainer.run.step as step

    config = run_config.load(None, overrides(warm_model, **{
        "train.minibatches": 2, "train.epochs": 2, "objective.clip_eps": 0.2, "rollout.recompute_logprobs": "true"}))
    run = Run(config, tmp_path / "ppo")
    seen = []
    real = step.policy_loss

    def recording(current, rows, *args, **rest):
        logp, old_logp = current.logp.detach(), rows.old_logp
        seen.append((logp.shape[0], old_logp is not None, float(((logp - old_logp).abs() * rows.mask).max())))
        return real(current, rows, *args, **rest)

    monkeypatch.setattr(step, "policy_loss", recording)
    line = run.run_step()
    assert [rows for rows, _, _ in seen] == [8, 8, 8, 8]  # 4 prompts x 4 samples, in 2 minibatches, twice
    assert all(has_old for _, has_old, _ in seen)  # the behaviour log-probs feed the importance ratio
    lp = logprob_rounding(run.lm)
    assert seen[0][2] <= lp  # recomputed by the trainer: the first update starts at ratio 1
    assert seen[2][2] > lp  # after two updates the policy has moved: a real off-policy ratio
    assert 0.0 <= line["clip_frac"] <= 1.0


def test_training_with_sequence_level_weights_off_policy(warm_model, tmp_path):
    """pg_ratio and kl_loss_ratio sequence, on rollouts two steps stale: the weights move off 1, every
    update is finite, and a cap truncates some of them."""
    config = run_config.load(None, overrides(warm_model, **{
        "train.async_level": 2, "train.steps": 5, "objective.pg_ratio": "sequence",
        "objective.kl_loss_ratio": "sequence", "objective.sequence_ratio_cap": 1.02}))
    run = Run(config, tmp_path / "sequence")
    lines = [run.run_step() for _ in range(5)]
    run.verifier.close()
    stale = lines[1:]  # steps 0-2 train on the initial policy's rollouts: only step 0's are fresh
    response = TOY_RUN["rollout.max_new_tokens"] * logprob_rounding(run.lm)  # a response's log-prob rounding
    assert lines[0]["seq_ratio_mean"] == pytest.approx(1.0, abs=response)  # the engine's log-probs, not exactly 1
    assert any(abs(line["seq_ratio_max"] - 1.0) > 1e-4 or line["seq_ratio_min"] < 1 - 1e-4 for line in stale)
    assert all(line["seq_ratio_max"] <= 1.02 + 1e-9 for line in lines)
    assert any(line["seq_ratio_truncated_frac"] > 0 for line in stale)
    assert all(math.isfinite(line["loss"]) and not line.get("skipped_updates") for line in lines)


@pytest.mark.parametrize("preset, async_level", [("paper-k1-reward", 3), ("verl-reward", 0), ("nemo-rl-reward", 1)])
def test_training_with_a_presets_whole_objective(warm_model, tmp_path, preset, async_level):
    """The Comedy paper's objective on stale rollouts (its ratio bounded at 8, its KL centred by the sampler's group
    mean), and the libraries' whitened per-token KL rewards: the loop hands the response mask and the sampler's KL
    to the advantages, and every update is finite."""
    base = {k: v for k, v in TOY_RUN.items() if not k.startswith("objective.")}
    config = run_config.load(None, overrides(warm_model, base, **{
        "objective.preset": preset, "objective.beta": 0.1, "train.async_level": async_level, "train.steps": 5}))
    run = Run(config, tmp_path / preset)
    lines = [run.run_step() for _ in range(5)]
    run.verifier.close()
    assert all(math.isfinite(line["loss"]) and not line.get("skipped_updates") for line in lines)
    if config.objective.ratio_cap is not None:
        assert all("ratio_bounded_frac" in line for line in lines)


def test_a_paper_presets_step_takes_mu_from_the_trainer_and_each_rows_prompt_length(warm_model, tmp_path,
                                                                                       monkeypatch):
    """As the Comedy paper's fork: on stale rollouts the ratio's mu is the trainer's log-probs of the samples
    (rollout.recompute_logprobs, which the paper-* presets set), not the engine's, and the loss divides by each
    row's prompt and response tokens (the toy's prompts, "a+b=", have 4)."""
    import trainer.run.step as step

    base = {k: v for k, v in TOY_RUN.items() if not k.startswith("objective.")}
    config = run_config.load(None, overrides(warm_model, base, **{
        "objective.preset": "paper-k3-loss", "train.async_level": 1, "train.steps": 1}))
    assert config.rollout.recompute_logprobs and config.objective.loss_agg == "seq-mean-token-sum-seq-len"
    run = Run(config, tmp_path / "paper")
    batches, prompts = [], []
    real_batch, real_loss = step.step_batch, step.policy_loss

    def recording_batch(*args):
        batches.append(real_batch(*args))
        return batches[-1]

    def recording_loss(current, rows, *args, **rest):
        prompts.append(rows.prompt_lengths)
        return real_loss(current, rows, *args, **rest)

    monkeypatch.setattr(step, "step_batch", recording_batch)
    monkeypatch.setattr(step, "policy_loss", recording_loss)
    line = run.run_step()
    run.verifier.close()
    sb = batches[0]
    assert sb.trainer_logp is not None and sb.old_logp is sb.trainer_logp
    assert [length for part in prompts for length in part.tolist()] == [4] * 16
    assert math.isfinite(line["loss"])


@pytest.mark.parametrize("reward_kl", ["current", "sampler"])
def test_training_with_the_full_vocabulary_kl_and_sequence_weights(warm_model, tmp_path, reward_kl):
    """Estimator full in the reward and the loss, on rollouts one step stale under sequence weights.
    The KL in the reward is the policy's own (current: the same as the loss pass's kl_full) or that of
    the policy that sampled, fixed for the batch (sampler: not the policy that is being updated)."""
    beta = 0.5
    config = run_config.load(None, overrides(warm_model, **{
        "train.async_level": 1, "train.steps": 4, "train.lr": "1e-3", "train.logprob_chunk": 5,
        "objective.estimator": "full", "objective.placement": "reward+loss", "objective.beta": beta,
        "objective.pg_ratio": "sequence", "objective.kl_loss_ratio": "sequence", "objective.reward_kl": reward_kl}))
    run = Run(config, tmp_path / reward_kl)
    lines = [run.run_step() for _ in range(4)]
    run.verifier.close()
    assert all(math.isfinite(line["loss"]) and not line["skipped_updates"] for line in lines)
    # a response's KL_t, each sum_v p_v (log p_v - log q_v), round as two log-probs do
    noise = 2 * TOY_RUN["rollout.max_new_tokens"] * logprob_rounding(run.lm)
    assert abs(lines[0]["kl_full"]) <= noise and lines[-1]["kl_full"] > noise  # pi moves off pi_ref
    assert all(line["kl_full"] >= -noise for line in lines)  # an exact KL: never negative, unlike kl_k1
    shaped_by_current = [line["reward_mean"] - beta * line["kl_full"] for line in lines]
    gaps = [abs(line["reward_shaped_mean"] - expected) for line, expected in zip(lines, shaped_by_current, strict=True)]
    if reward_kl == "current":
        assert max(gaps) <= beta * noise
    else:  # rollouts of step s - 1: their sampler's KL, one update behind
        assert gaps[0] <= beta * noise and max(gaps[2:]) > beta * noise


def test_tis_against_an_exact_engine_weights_every_token_by_one(warm_model, tmp_path):
    config = run_config.load(None, overrides(warm_model, **{"objective.tis_cap": 2.0, "train.minibatches": 2}))
    run = Run(config, tmp_path / "tis")
    line = run.run_step()
    run.verifier.close()
    lp = logprob_rounding(run.lm)  # exp of one log-prob's rounding: 1 to first order
    assert line["tis_weight_mean"] == pytest.approx(1.0, abs=lp) and line["tis_truncated_frac"] == 0.0
    assert line["mismatch_logp_mean"] <= lp


def test_a_run_killed_before_its_first_checkpoint_starts_over_with_clean_metrics(warm_model, tmp_path):
    """Ctrl-C between a step's metrics line and its checkpoint: the lines written so far go, instead of
    being followed by a second step 0 (a reduced study under Snakemake found this)."""
    out = tmp_path / "early"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward_mean": 9.0}) + "\n" for i in range(3)))
    (out / "objective.jsonl").write_text(json.dumps({"step": 3, "kl": 9.0}) + "\n")
    done = train_cli(out, warm_model, **{"train.steps": 2})
    assert done.returncode == 0, done.stderr
    assert [m["step"] for m in metrics(out)] == [0, 1] and all(m["reward_mean"] != 9.0 for m in metrics(out))
    assert (out / "objective.jsonl").read_text() == ""


def test_train_runs_trains_a_plan_in_one_process_as_single_runs_would(warm_model, tmp_path):
    short = {"train.steps": 2, "checkpoint.every": 1}
    plan = {str(tmp_path / "a"): overrides(warm_model, **short, **{"train.seed": 1}),
            str(tmp_path / "b"): overrides(warm_model, **short, **{"train.seed": 2})}
    done = subprocess.run([sys.executable, "-m", "trainer", "train-runs", "--plan", json.dumps(plan)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "run 2 of 2" in done.stderr and (tmp_path / "a" / COMPLETE).exists() and (tmp_path / "b" / COMPLETE).exists()
    alone = train_cli(tmp_path / "b-alone", warm_model, **short, **{"train.seed": 2})
    assert alone.returncode == 0, alone.stderr
    assert _comparable(metrics(tmp_path / "b")) == _comparable(metrics(tmp_path / "b-alone"))  # nothing leaks over
    assert _comparable(metrics(tmp_path / "a")) != _comparable(metrics(tmp_path / "b"))

    # (a bad config anywhere in the plan: tests/test_train_config.py)
    # a run that fails does not stop the next one
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.yaml").write_text("train: {steps: 99}\n")  # another run's directory
    mixed = {str(tmp_path / "e"): overrides(warm_model, **short), str(tmp_path / "f"): overrides(warm_model, **short)}
    partly = subprocess.run([sys.executable, "-m", "trainer", "train-runs", "--plan", json.dumps(mixed)],
                            capture_output=True, text=True, timeout=600)
    assert partly.returncode == 1 and "holds a run with a different config" in partly.stderr
    assert (tmp_path / "f" / COMPLETE).exists() and "1 of 2 runs failed" in partly.stderr


def test_a_sigterm_in_a_runs_last_step_completes_it_and_train_runs_starts_no_other(warm_model, tmp_path,
                                                                                     monkeypatch):
    """SLURM's warning can reach a bundled job in a run's last step: that run completes (there is nothing
    left to checkpoint), and no other run starts in the grace period before the job is requeued. (A SLURM
    requeue check found the next run trained to its end inside that period.)"""
    from trainer.run import loop

    steps, real_step = 2, loop.Run.run_step

    def signalled_in_the_last_step(run):
        line = real_step(run)
        if run.state.step == steps:
            os.kill(os.getpid(), signal.SIGTERM)  # lands in the handler of train-runs' one SigtermFlag
        return line

    monkeypatch.setattr(loop.Run, "run_step", signalled_in_the_last_step)
    short = {"train.steps": steps, "checkpoint.every": 1}
    plan = {str(tmp_path / "a"): overrides(warm_model, **short), str(tmp_path / "b"): overrides(warm_model, **short)}
    result = trainer_in_process("train-runs", "--plan", json.dumps(plan))
    assert result.returncode == EXIT_PREEMPTED, result.stderr
    assert (tmp_path / "a" / COMPLETE).exists() and not (tmp_path / "b").exists()
    assert f"{tmp_path / 'b'} not started: SIGTERM came before it" in result.stderr


def test_a_model_with_dropout_trains_without_it(warm_model, tmp_path):
    """Llama with attention_dropout 0.1 (applied in train mode, inside the attention kernel): at step 0
    the policy is its reference, and every pass of it gives the reference's log-probs exactly."""
    model = tmp_path / "dropout-model"
    shutil.copytree(warm_model, model)
    config_file = model / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "attention_dropout": 0.1}))
    run = Run(run_config.load(None, overrides(model, **{"objective.estimator": "k1"})), tmp_path / "run")
    line = run.run_step()
    run.verifier.close()
    assert line["kl_k1"] == 0.0 and line["kl_k3"] == 0.0


def test_an_on_policy_update_makes_the_trainers_logprobs_of_the_samples_in_its_own_pass(warm_model, tmp_path,
                                                                                        monkeypatch):
    """One update over the whole batch with the sampler's weights: its first pass stands in for a pass of its
    own after generation, one forward pass less per step, and every metric and weight is the same."""
    config = run_config.load(None, overrides(warm_model, **{"objective.estimator": "k3",
                                                          "objective.placement": "loss"}))
    passes = []

    def run(out):
        trainer = Run(config, tmp_path / out)
        hook = trainer.lm.model.register_forward_pre_hook(lambda module, args: passes.append(out))
        lines = [_comparable([trainer.run_step()]) for _ in range(2)]
        hook.remove()
        trainer.verifier.close()
        return lines, [p.detach().clone() for p in trainer.lm.parameters()]

    lines, weights = run("one-pass")
    monkeypatch.setattr(Producer, "update_makes_trainer_logprobs", lambda self: False)
    separate_lines, separate_weights = run("own-pass")
    assert lines == separate_lines and all(torch.equal(a, b) for a, b in zip(weights, separate_weights, strict=True))
    assert passes.count("own-pass") - passes.count("one-pass") == 2  # the policy's passes (the engine's too)
