"""Micro-batches, gradient checkpointing and several processes make the update one process makes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from rounding import assert_same_statistic, statistic_rounding
from run_helpers import TOY_RUN, command, metrics, objective, overrides, train_cli
from safetensors.torch import load_file

from trainer import config as run_config
from trainer.launch import train_command
from trainer.model.models import load_model
from trainer.run import TIMING_KEYS, Run

# 2 steps, larger lr and beta, token-mean: what the comparisons of one process with several need
RUN = {**TOY_RUN, "objective.beta": 0.1, "objective.loss_agg": "token-mean", "train.lr": "1e-3", "train.steps": 2,
       "checkpoint.every": 1}


def _overrides(model, **extra):
    return overrides(model, RUN, **extra)


def _one_step(model, tmp_path, name, **extra):
    """One step's metrics and its gradient (Adam's first step is blind to the gradient's scale)."""
    run = Run(run_config.load(None, _overrides(model, **extra)), tmp_path / name)
    line = run.run_step()
    return line, {name: p.grad.detach().clone() for name, p in run.lm.named_parameters()}


def _assert_close(a, b, atol):
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol, rtol=0), (key, (a[key] - b[key]).abs().max())


@pytest.fixture(scope="module")
def noise_floor(warm_model):
    return statistic_rounding(load_model(str(warm_model)), RUN)


@pytest.mark.parametrize("extra", [
    {"train.micro_batch_size": 4},                                   # 4 micro-batches of one group
    {"train.micro_batch_size": 8, "objective.loss_agg": "seq-mean-token-mean"},
    {"train.micro_batch_size": 4, "objective.loss_agg": "seq-mean-token-sum-seq-len"},  # each row's prompt read
    {"train.gradient_checkpointing": "true"},
    {"train.micro_batch_size": 4, "train.gradient_checkpointing": "true", "train.logprob_chunk": 0},
    # advantages normalised over the whole minibatch: computed once for it, not per micro-batch
    {"train.micro_batch_size": 4, "objective.advantage": "reinforce++"},
    # the exact full-vocabulary KL, in the reward and the loss, in chunks of 3 tokens
    {"train.micro_batch_size": 4, "objective.estimator": "full", "objective.placement": "reward+loss",
     "train.logprob_chunk": 3},
])
def test_micro_batches_and_checkpointing_make_the_same_update(warm_model, tmp_path, extra, noise_floor):
    same = {k: v for k, v in extra.items() if k.startswith("objective") or (k == "train.logprob_chunk" and v)}
    whole, grad_whole = _one_step(warm_model, tmp_path, "whole", **same)
    parts, grad_parts = _one_step(warm_model, tmp_path, "parts", **extra)
    largest = max(float(g.abs().max()) for g in grad_whole.values())
    _assert_close(grad_whole, grad_parts, atol=1e-5 * largest)
    assert parts.keys() == whole.keys()
    for key in parts.keys() - set(TIMING_KEYS):
        assert_same_statistic(key, whole[key], parts[key], 1e-5, noise_floor)


def _train(out, model, processes, **extra):
    done = train_cli(out, model, processes, 900, RUN, **extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return metrics(out)


def _assert_one_and_two_processes_train_alike(tmp_path, model, noise_floor, **extra):
    """The run in one process and in two (two minibatches, micro-batches of 4 in two) log the same statistics to
    rounding, and end with the same weights."""
    one = _train(tmp_path / "one", model, 1, **{"train.minibatches": 2, **extra})  # 8 rows per update
    two = _train(tmp_path / "two", model, 2, **{"train.minibatches": 2, "train.micro_batch_size": 4, **extra})
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        for key in a.keys() - set(TIMING_KEYS):  # every statistic, pooled over processes as over one batch
            assert_same_statistic(f"step {a['step']}: {key}", a[key], b[key], 1e-4, noise_floor)
    # two Adam steps of lr 1e-3 move each weight by about 2e-3 (Adam's step is about lr, whatever the
    # gradient's size); gradients equal to float noise move them the same to 1% of that
    _assert_close(load_file(tmp_path / "one" / "final" / "model.safetensors"),
                  load_file(tmp_path / "two" / "final" / "model.safetensors"), atol=0.01 * 2 * float(RUN["train.lr"]))


@pytest.mark.slow
def test_two_processes_make_the_same_updates_as_one(warm_model, tmp_path, noise_floor):
    """accelerate launch, two CPU processes over gloo, FSDP2-sharded policy and reference, the hf engine
    on a synced replica, two minibatches split over both, micro-batches: the run of one process. With
    REINFORCE++'s advantages, normalised over the whole minibatch: every process's rows together."""
    measure = {"measure.prompts": 6, "measure.samples": 3, "measure.reference_samples": 4,  # 3 prompts each
               "objective.advantage": "reinforce++"}
    _assert_one_and_two_processes_train_alike(tmp_path, warm_model, noise_floor, **measure)
    # the objective measured by both processes, each on its share of the held-out prompts, gathered in order
    (a,), (b,) = (objective(tmp_path / name) for name in ("one", "two"))
    assert b["per_prompt"]["reward"] == a["per_prompt"]["reward"] and b["reference_reward"] == a["reference_reward"]
    for kl_one, kl_two in zip(a["per_prompt"]["kl"], b["per_prompt"]["kl"], strict=True):  # each a sum of KL_t
        assert_same_statistic("per-prompt KL", kl_one, kl_two, 1e-4, 2 * noise_floor)
    assert a["step"] == b["step"] == 2
    state = torch.load(tmp_path / "two" / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert len(state["processes"]) == 2 and state["step"] == 2
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step_1", "step_2"]


@pytest.mark.slow
def test_the_exact_kl_and_entropy_over_two_processes_make_the_updates_of_one(warm_model, tmp_path, noise_floor):
    """The full-vocabulary KL in the reward and the loss, and the entropy bonus, read the output layer outside the
    LM's own forward pass; FSDP2 shards it: computed inside the root's forward, two processes train as one."""
    full = {"objective.estimator": "full", "objective.placement": "reward+loss", "train.logprob_chunk": 3,
            "objective.entropy_coef": 0.01}
    _assert_one_and_two_processes_train_alike(tmp_path, warm_model, noise_floor, **full)


def test_bf16_mixed_precision_keeps_float32_weights_and_follows_the_float32_gradient(warm_model, tmp_path):
    _, exact = _one_step(warm_model, tmp_path, "f32")
    line, mixed = _one_step(warm_model, tmp_path, "bf16", **{"train.mixed_precision": "bf16"})
    assert all(g.dtype == torch.float32 for g in mixed.values())
    flat_exact = torch.cat([g.flatten() for g in exact.values()])
    flat_mixed = torch.cat([g.flatten() for g in mixed.values()])
    assert torch.nn.functional.cosine_similarity(flat_exact, flat_mixed, dim=0) > 0.99
    assert flat_mixed.ne(flat_exact).any()  # it did compute in bfloat16
    assert line["skipped_updates"] == 0


def test_under_bf16_mixed_precision_the_hf_engine_samples_as_the_trainer_computes(warm_model, tmp_path, monkeypatch):
    """In bfloat16 under the trainer's autocast, not in float32: a float32 sampler is another policy than
    the one trained (0.01 nats apart on the warm toy; 5e-7 under the same autocast)."""
    from trainer.rollout.hf import HFEngine

    precision, real = [], HFEngine.generate

    def recording(self, *args, **kwargs):
        precision.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", recording)
    _one_step(warm_model, tmp_path, "bf16", **{"train.mixed_precision": "bf16"})
    _one_step(warm_model, tmp_path, "f32")
    assert precision == [torch.bfloat16, torch.float32]


@pytest.mark.slow
def test_sigterm_stops_every_process_at_a_checkpoint_and_the_same_command_resumes(warm_model, tmp_path, noise_floor):
    """As a scheduler's preemption does it: SIGTERM to the launcher's whole process group."""
    out = tmp_path / "two"
    extra = {"train.steps": 12, "checkpoint.every": 100}
    job_command = command(out, warm_model, 2, RUN, **extra)
    job = subprocess.Popen(job_command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and job.poll() is None:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGTERM)
    _, stderr = job.communicate(timeout=600)
    assert job.returncode != 0, stderr[-2000:]
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    assert len(saved) == 1 and not (out / "COMPLETE").exists(), (saved, stderr[-2000:])
    assert stderr.count("checkpoint written, exiting with 75") == 2  # both processes stopped cleanly
    resumed = subprocess.run(job_command, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count(f"resumed from checkpoint {saved[0]}") == 2
    lines = metrics(out)
    assert [line["step"] for line in lines] == list(range(12))
    one = _train(tmp_path / "one", warm_model, 1, **extra)  # uninterrupted, one process
    for a, b in zip(one, lines, strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"])
        assert_same_statistic(f"step {a['step']}: loss", a["loss"], b["loss"], 1e-4, noise_floor)


def test_a_bad_run_directory_stops_every_process_with_the_error(warm_model, tmp_path):
    """The main process finds the error; the others must not wait for it forever."""
    import yaml

    out = tmp_path / "taken"
    out.mkdir()
    other = run_config.load(None, _overrides(warm_model, **{"train.lr": "5e-4"}))
    (out / "config.yaml").write_text(yaml.safe_dump(other.to_dict(), sort_keys=False))
    done = train_cli(out, warm_model, 2, 300, RUN)
    assert done.returncode != 0
    assert done.stderr.count("holds a run with a different config (train.lr)") == 2


def test_two_runs_in_one_pair_of_processes_each_train_as_they_would_alone(warm_model, tmp_path):
    """A training job of several processes and a bundle of runs (`train-runs`, the study's bundle.train): the
    processes join their group once and keep it from one run to the next. Re-joining it for the second run
    hung: rank 0 waited to re-form the group while rank 1 went on in the old one (the paper rehearsal across
    two hosts found it)."""
    plan = {str(tmp_path / name): _overrides(warm_model, **{"train.seed": seed}) for name, seed in (("a", 1), ("b", 2))}
    job = subprocess.Popen([*train_command(sys.executable, 2), "train-runs", "--plan", json.dumps(plan)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = job.communicate(timeout=300)  # two runs of two steps: under a minute
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # the launcher and both ranks
        pytest.fail(f"two runs in one pair of processes hung: {job.communicate()[1][-3000:]}")
    assert job.returncode == 0, stderr[-3000:]
    assert stderr.count("process 0 of 2") == stderr.count("process 1 of 2") == 1  # joined once
    alone = train_cli(tmp_path / "b-alone", warm_model, 2, 600, RUN, **{"train.seed": 2})
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics(tmp_path / "b")] == \
        [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics(tmp_path / "b-alone")]


def test_a_run_that_fails_in_every_process_of_a_bundle_stops_no_other(warm_model, tmp_path):
    """Both processes fail the first run alike (its directory holds another run): they go on to the second
    together, as one process would."""
    import yaml

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "config.yaml").write_text(yaml.safe_dump(
        run_config.load(None, _overrides(warm_model, **{"train.lr": "5e-4"})).to_dict(), sort_keys=False))
    plan = {str(taken): _overrides(warm_model), str(tmp_path / "next"): _overrides(warm_model)}
    done = subprocess.run([*train_command(sys.executable, 2), "train-runs", "--plan", json.dumps(plan)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.count("holds a run with a different config") == 2, done.stderr[-3000:]
    assert "every process stops here" not in done.stderr
    assert [m["step"] for m in metrics(tmp_path / "next")] == [0, 1]
