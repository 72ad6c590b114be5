"""The RL training loop: rollouts, rewards, update, metrics, checkpoints, resume.

`train(config, out_dir)` runs (or resumes, or skips if finished) one run. The run directory holds
config.yaml, metrics.jsonl (one line per step), checkpoints/step_N/, final/ (an HF model directory
with the tokenizer) and COMPLETE. SIGTERM makes the run checkpoint after the current step and exit
with EXIT_PREEMPTED, so that a scheduler can requeue it and the same command resumes it.

Started by `accelerate launch` (or torchrun) as several processes, the run shards the policy and
the reference with FSDP2 (`trainer.distributed`). Each process generates, scores and trains on its
share of every minibatch's prompts; the main process writes everything in the run directory. The
update is the one a single process would make: each prompt samples from its own seed, and every
loss part is normalised by the whole minibatch's rows and tokens.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import random
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from eval.verify import Verifier, VerifierUnavailable
from trainer import checkpoint
from trainer.audits.objective_measure import ObjectiveProbe
from trainer.config import ConfigError, RunConfig, as_saved, differences
from trainer.distributed import (
    World,
    full_optimizer_state,
    full_parameters,
    full_state_dict,
    grad_norm,
    load_full_state_dict,
    load_optimizer_state,
    shard,
)
from trainer.lease import Lease, LeaseHeld, LeaseLost, slurm_job
from trainer.model.dropout import disable_dropout
from trainer.model.logprobs import CompletionLogprobs, PackedBatch, pack, states_of_rows, token_matrix
from trainer.model.models import load_model, load_tokenizer, resolve, save_pretrained_atomic
from trainer.objective import entropy_bonus, kl, reference_refresh
from trainer.objective.full_kl import HeadInputs
from trainer.objective.kl_coefficient import KLCoefficient
from trainer.objective.loss import Advantages, advantage_stats, batch_advantages, combine_stats, policy_loss, reward_kl
from trainer.objective.objective_config import ObjectiveConfig
from trainer.progress import progress_bar
from trainer.rollout import make_engine
from trainer.rollout.base import Rollouts, SamplingParams, sample_seeds
from trainer.run_files import (
    COMPLETE,
    CONFIG,
    METRICS,
    OBJECTIVE,
    OBJECTIVE_REFERENCE,
    TRAIN_LOG,
    clear_failure,
    read_metrics,
    record_failure,
)
from trainer.tasks import DataOrder, Task, make_task

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on SIGTERM; run the same command again to resume
TIMING_KEYS = ("step_time", "gen_time", "train_time", "tokens_per_s")  # the only non-reproducible metrics


class TrainingError(RuntimeError):
    """A run that cannot go on (for example too many non-finite updates in a row)."""


class DirectoryTaken(ConfigError):
    """--out holds a run started with another config: the run is someone else's, so nothing is written there."""


class Preempted(Exception):
    """Raised after the checkpoint that SIGTERM asked for has been written."""


@dataclass
class PendingBatch:
    """Rollouts and their rewards, generated ahead of the step that trains on them when async_level > 0.

    trainer_logprobs  the trainer's log-probs of the sampled tokens under the policy that sampled
                      them (computed right after generation; None where the step's update computes
                      them in its first pass, `Run._update_makes_trainer_logprobs`); rollouts.logprobs
                      are the engine's
    trainer_token_kl  the exact KL(pi || pi_ref) over the vocabulary at each sampled position, under
                      the policy that sampled (only where estimator full shapes the reward)
    reference         the reference's log-probs and completion states of the batch, from the pass that
                      trainer_token_kl needed: the step reuses them (kept in memory only; a resumed
                      run computes them again)
    """

    policy_step: int
    rollouts: Rollouts
    rewards: list[float]
    trainer_logprobs: list[list[float]] | None
    trainer_token_kl: list[list[float]] | None = None
    reference: tuple[torch.Tensor, HeadInputs] | None = field(default=None, repr=False)

    def to_state(self) -> dict[str, Any]:
        return {"policy_step": self.policy_step, "rollouts": self.rollouts.to_state(), "rewards": self.rewards,
                "trainer_logprobs": self.trainer_logprobs, "trainer_token_kl": self.trainer_token_kl}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PendingBatch":
        rollouts = Rollouts.from_state(state["rollouts"])
        trainer_logprobs = state.get("trainer_logprobs")
        if trainer_logprobs is None:  # a checkpoint from before they were kept: the engine's stand in
            log.warning("a pending batch of the checkpoint has no trainer log-probs; the engine's stand in for them")
            trainer_logprobs = rollouts.logprobs
        return cls(state["policy_step"], rollouts, state["rewards"], trainer_logprobs, state.get("trainer_token_kl"))


def mismatch_sums(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs of sampled tokens are from the trainer's, as sums over tokens
    (so that processes add up): |delta log p| and k3 = r - 1 - log r with r = pi_trainer / mu_engine,
    whose mean estimates KL(mu_engine || pi_trainer) per token from the engine's samples (>= 0)."""
    log_ratio = (trainer_logp.double() - engine_logp.double()) * mask
    k3 = (torch.expm1(log_ratio) - log_ratio) * mask  # expm1 in float64: no rounding below 0 near r = 1
    return {"abs_sum": float(log_ratio.abs().sum()), "abs_max": float(log_ratio.abs().max()),  # pack: >= 1 column
            "k3_sum": float(k3.sum()), "tokens": float(mask.sum())}


def _schedule(config: RunConfig, total_updates: int):
    t = config.train

    def factor(update: int) -> float:
        if update < t.warmup_steps:
            return (update + 1) / (t.warmup_steps + 1)
        progress = (update - t.warmup_steps) / max(1, total_updates - t.warmup_steps)
        if t.lr_schedule == "linear":
            return max(0.0, 1 - progress)
        if t.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def _adamw(model, config: RunConfig) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for all parameters) where this torch supports it for these parameters."""
    t = config.train
    kwargs = dict(lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)
    try:
        return torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(model.parameters(), **kwargs)


class _SigtermFlag:
    """Records SIGTERM instead of dying, so the loop can checkpoint first."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: Any = None

    def __enter__(self) -> "_SigtermFlag":
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM received: checkpointing after this step, then exiting with %d", EXIT_PREEMPTED)
        self.raised = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def check_before_loading(config: RunConfig) -> Task:
    """Everything that can be checked before a model loads: the model's location and the data."""
    try:
        resolve(config.model.path)
    except ValueError as error:
        raise ConfigError(f"model.path: {error}") from None
    return make_task(config.task.name, config.task.options)


def _checkpoint_activations(lm) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant, as FSDP2 needs)."""
    enable = getattr(lm, "activation_checkpointing_enable", None)  # transformers 5's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _check_world(config: RunConfig, world: World) -> None:
    """Every process must hold whole groups of every minibatch, in whole micro-batches."""
    t = config.train
    per_minibatch = t.prompts_per_step // t.minibatches
    if per_minibatch % world.size:
        raise ConfigError(f"train.prompts_per_step: {t.prompts_per_step} prompts in {t.minibatches} minibatch(es) "
                          f"do not split evenly over {world.size} processes")
    rows = per_minibatch // world.size * t.group_size
    if t.micro_batch_size and rows % t.micro_batch_size:
        raise ConfigError(f"train.micro_batch_size: {t.micro_batch_size} does not divide the {rows} completions "
                          f"each process trains on per minibatch")
    if world.sharded and config.objective.needs_full_kl:
        raise ConfigError(f"objective.estimator: {config.objective.estimator} reads the reference's output layer "
                          "outside its forward pass, which FSDP shards: run it in one process")
    if world.sharded and config.objective.entropy_coef:
        raise ConfigError("objective.entropy_coef: the exact entropy reads the output layer outside the forward "
                          "pass, which FSDP shards: run it in one process")
    if config.measure.prompts % world.size:
        raise ConfigError(f"measure.prompts: {config.measure.prompts} held-out prompts do not split evenly over "
                          f"{world.size} processes")


def _stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-response values [B] or per-token ones [B_i, T_i] of several processes, as one batch (per-token
    rows padded with 0 to the widest: each process packs its own completions)."""
    if parts[0].dim() == 1:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


class Run:
    """One training run in `out_dir`; `train()` is the entry point."""

    def __init__(self, config: RunConfig, out_dir: Path, world: World | None = None) -> None:
        world = world or World()
        self.config, self.out, self.world = config, Path(out_dir), world
        self.task = check_before_loading(config)
        _check_world(config, world)
        self.lease: Lease | None = None  # the main process's, on the run directory
        self._claim_directory()
        c = config
        self.tokenizer = load_tokenizer(c.model.path)
        lm = load_model(c.model.path, c.model.dtype, world.device(c.model.device))
        disable_dropout(lm)  # trained in train mode, without its noise (so are the copies below)
        reference = copy.deepcopy(lm).eval().requires_grad_(False)  # the initial weights, also on resume
        # a refreshed reference moves: the measured objective stays that of the original one
        original = copy.deepcopy(reference) if c.objective.ref_refresh_every and c.measure.prompts else None
        replica = copy.deepcopy(lm).eval() if world.sharded and c.rollout.engine == "hf" else None
        self.resumed = checkpoint.load_latest(self.checkpoints_dir, lm)  # before sharding: every process reads it
        if c.train.gradient_checkpointing:
            _checkpoint_activations(lm)
        self.lm = lm.train()
        self.policy = CompletionLogprobs(lm, c.rollout.temperature, c.train.logprob_chunk)
        self.reference = CompletionLogprobs(reference, c.rollout.temperature, c.train.logprob_chunk)
        self.original_reference = self.reference if original is None else CompletionLogprobs(
            original, c.rollout.temperature, c.train.logprob_chunk)
        bf16 = torch.bfloat16 if c.train.mixed_precision == "bf16" else None
        if world.sharded:
            shard(self.policy, lm, bf16)
            shard(self.reference, reference, bf16)
            if original is not None:
                shard(self.original_reference, original, bf16)
        self.autocast_dtype = bf16 if not world.sharded else None
        self.device = next(lm.parameters()).device
        self.engine = make_engine(c, self._engine_model(replica), self.tokenizer, world,
                                  weights=lambda: full_parameters(self.policy, prefix="lm."))
        if self.resumed is not None:
            self.engine.sync_weights()
        self.params = SamplingParams(n=c.train.group_size, temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                                     max_new_tokens=c.rollout.max_new_tokens, stop=tuple(c.rollout.stop))
        self.optimizer = _adamw(self.policy, c)
        total_updates = c.train.steps * c.train.minibatches * c.train.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(c, total_updates))
        self.order = DataOrder(len(self.task), c.train.seed)
        self.verifier = Verifier(timeout=c.verifier.timeout, workers=c.verifier.workers)
        self.step, self.data_position, self.nonfinite_in_row = 0, 0, 0
        self.coefficient = KLCoefficient(c.objective)  # beta, adapted as the run trains (objective.kl_target)
        self.saved_step = self.resumed[0] if self.resumed is not None else None
        self.pending: deque[PendingBatch] = deque()
        self.probe = ObjectiveProbe(c, self.tokenizer, world) if c.measure.prompts else None
        self.reference_record: dict[str, Any] | None = None
        torch.manual_seed(c.train.seed)
        np.random.seed(c.train.seed)
        random.seed(c.train.seed)

    def _engine_model(self, replica):
        """The model the engine is given: a replica when the policy is sharded, else the policy itself."""
        return replica if replica is not None else self.lm

    # --- run directory ----------------------------------------------------------------------

    def _claim_directory(self) -> None:
        """The main process takes the run directory's lease (trainer.lease), then writes config.yaml, or
        checks that a run already here was started with the same config; every process then raises its
        error, if any (none is left waiting)."""
        problem = None
        if self.world.main:
            try:
                self.lease = Lease.acquire(self.out)
                self._check_or_write_config()
                clear_failure(self.out)  # this attempt replaces the last one's record
            except ValueError as error:  # ConfigError, LeaseHeld, DirectoryTaken
                self.release()
                problem = (type(error).__name__, str(error))
        problems = [p for p in self.world.gather(problem) if p]
        if problems:
            kind, message = problems[0]
            raise {cls.__name__: cls for cls in (LeaseHeld, DirectoryTaken)}.get(kind, ConfigError)(message)

    def _check_or_write_config(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        config_file = self.out / CONFIG
        wanted = self.config.to_dict()
        if config_file.exists():
            changed = differences(wanted, as_saved(yaml.safe_load(config_file.read_text())))
            if changed:
                raise DirectoryTaken(f"--out {self.out} holds a run with a different config ({', '.join(changed)}); "
                                  "use another --out, or the same config to resume it")
        else:
            config_file.write_text(yaml.safe_dump(wanted, sort_keys=False))

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    @property
    def checkpoints_dir(self) -> Path:
        return self.out / "checkpoints"

    # --- state ------------------------------------------------------------------------------

    def process_state(self) -> dict[str, Any]:
        """What differs between processes: random states, rollouts generated ahead, verifier counts."""
        return {
            "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(), "python_rng": random.getstate(),
            "pending": [p.to_state() for p in self.pending],
            "verifier_counts": dict(self.verifier.counts),
        }

    def restore(self) -> None:
        """Continue from the checkpoint whose weights __init__ loaded, if any. Without one the run starts
        over: lines that a run killed before its first checkpoint wrote are dropped."""
        if self.resumed is None:
            if self.world.main:
                self._truncate_metrics(0)
            return
        step, state = self.resumed
        processes = state.get("processes") or [state]  # a checkpoint from before multi-process runs
        if len(processes) != self.world.size:
            raise ConfigError(f"{self.checkpoints_dir}/step_{step} was written by {len(processes)} training "
                              f"process(es); resume it with as many, not {self.world.size}")
        self.step, self.data_position = state["step"], state["data_position"]
        self.nonfinite_in_row = state["nonfinite_in_row"]
        if "kl_coefficient" in state:
            self.coefficient.load_state_dict(state["kl_coefficient"])
        if self.config.objective.ref_refresh_every:
            load_full_state_dict(self.reference, state["reference"], prefix="lm.")
        load_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        mine = processes[self.world.rank]
        torch.set_rng_state(mine["torch_rng"])
        np.random.set_state(mine["numpy_rng"])
        random.setstate(mine["python_rng"])
        self.pending = deque(PendingBatch.from_state(p) for p in mine["pending"])
        self.verifier.counts.update(mine["verifier_counts"])
        if self.world.main:
            self._truncate_metrics(step)
        log.info("resumed from checkpoint step_%d", step)

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics of steps after the checkpoint (and a torn last line): they are run again. A
        metrics line is numbered by the step it trained, an objective line by the updates before it."""
        for name, last in ((METRICS, step - 1), (OBJECTIVE, step)):
            path = self.out / name
            if path.exists():
                kept = [line for line in read_metrics(path) if line["step"] <= last]
                path.write_text("".join(json.dumps(line) + "\n" for line in kept))

    def save_checkpoint(self) -> None:
        """Every process joins in gathering the weights and optimizer state; the main process writes."""
        c = self.config.checkpoint
        weights = full_state_dict(self.policy, prefix="lm.")
        state = {"step": self.step, "data_position": self.data_position, "nonfinite_in_row": self.nonfinite_in_row,
                 "kl_coefficient": self.coefficient.state_dict(),
                 "optimizer": full_optimizer_state(self.policy, self.optimizer),
                 "scheduler": self.scheduler.state_dict(), "processes": self.world.gather(self.process_state())}
        if self.config.objective.ref_refresh_every:  # the reference moves: it is part of the run's state
            state["reference"] = full_state_dict(self.reference, prefix="lm.")
        if self.world.main:
            self.lease.check()
            checkpoint.save(self.checkpoints_dir, self.step, self.lm, state, c.keep, c.keep_every, self.tokenizer,
                            state_dict=weights)
        self.world.barrier()
        self.saved_step = self.step

    # --- one step ---------------------------------------------------------------------------

    def _encode_prompts(self, indices: list[int]) -> tuple[list[list[int]], list]:
        chat = self.config.model.chat_template
        problems = [self.task.problem(i) for i in indices]
        return self.task.prompt_ids(problems, self.tokenizer, chat), problems

    def _generate(self) -> PendingBatch:
        """This process's share of the next step's prompts, sampled, and their rewards."""
        t = self.config.train
        indices = self.order.take(self.data_position, t.prompts_per_step)
        seeds = sample_seeds(t.seed, self.data_position, t.prompts_per_step)
        self.data_position += t.prompts_per_step
        indices, seeds = zip(*self.world.my_share(list(zip(indices, seeds, strict=True)), t.minibatches), strict=True)
        prompt_ids, problems = self._encode_prompts(list(indices))
        with self._sampling_precision():
            rollouts = self.engine.generate(prompt_ids, self.params, list(seeds))
        packed = pack(rollouts, self.tokenizer.pad_token_id).to(self.device)
        objective = self.config.objective
        reference = None
        if objective.needs_full_kl and objective.kl_in_reward:  # the sampler's exact KL, for the reward
            reference = self._reference(packed, full=True)
        logp = token_kl = None
        if not self._update_makes_trainer_logprobs():  # the policy that just sampled, as the trainer computes it
            with torch.no_grad():
                states = None if reference is None else reference[1]
                logp, token_kl, _ = self._sampled_logprobs(packed, reference=states)

        def ragged(values: torch.Tensor) -> list[list[float]]:
            return [row[: len(tokens)].tolist() for row, tokens in zip(values.cpu(), rollouts.token_ids, strict=True)]

        expanded = [p for p in problems for _ in range(self.params.n)]
        try:
            rewards = self.task.reward(rollouts.texts, expanded, self.verifier)
        except VerifierUnavailable as error:
            raise TrainingError(str(error)) from None
        return PendingBatch(self.step, rollouts, rewards, None if logp is None else ragged(logp),
                            None if token_kl is None else ragged(token_kl), reference)

    def _update_makes_trainer_logprobs(self) -> bool:
        """Whether the step's one update computes the trainer's log-probs of the samples in its first forward
        pass, over the whole batch, before the weights change (on-policy, one update, one micro-batch), and no
        KL in the reward needs them before it: then that pass stands in for one of their own after generation
        (the same computation on the same weights: the same numbers)."""
        t = self.config.train
        rows = t.prompts_per_step // self.world.size * t.group_size
        return (t.async_level == 0 and t.minibatches == 1 and t.epochs == 1 and t.micro_batch_size in (0, rows)
                and not self.config.objective.kl_in_reward)

    def _precision(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _sampling_precision(self):
        """Under bf16 mixed precision the hf engine samples in bf16 too, as the trainer computes (vLLM is
        given the dtype instead): float32 sampling made the sampler another policy than the trained one."""
        if self.config.train.mixed_precision != "bf16" or self.config.rollout.engine != "hf":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _logprobs(self, model: CompletionLogprobs, batch: PackedBatch, with_entropy: bool = False):
        with self._precision():
            return model(batch, with_entropy)

    def _reference(self, batch: PackedBatch, full: bool) -> tuple[torch.Tensor, HeadInputs | None]:
        """The reference's log-probs of the sampled tokens and, with `full`, its completion states (what the
        exact KL is computed against), from one pass without gradient."""
        with torch.no_grad(), self._precision():
            if not full:
                return self.reference(batch)[0], None
            states = self.reference.completion_states(batch)
            return self.reference.logprobs_of(batch, states), states

    def _sampled_logprobs(self, batch: PackedBatch, with_entropy: bool = False,
                          reference: HeadInputs | None = None, entropy_grad: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The policy's log-probs of the sampled tokens; given the `reference`'s completion states of the
        batch, its exact KL to the reference at each position (else None); with `with_entropy`, each
        position's entropy (else None; with `entropy_grad`, always, with its gradient). [B, T] each."""
        if entropy_grad:
            with self._precision():
                return entropy_bonus.logprobs_with_entropy(self.policy, batch, reference)
        if reference is None:
            logp, entropy = self._logprobs(self.policy, batch, with_entropy)
            return logp, None, entropy
        with self._precision():
            logp, entropy, token_kl = self.policy.with_token_kl(batch, reference, with_entropy)
        return logp, token_kl, entropy

    def _update(self, batch: PackedBatch, adv: Advantages, ref_logp: torch.Tensor,
                old_logp: torch.Tensor | None, engine_logp: torch.Tensor | None,
                with_entropy: bool, ref_states: HeadInputs | None = None,
                logp_out: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer update on this process's part of a minibatch (whole groups, whose advantages
        `adv` were computed over the whole minibatch), a micro-batch at a time; skipped everywhere if
        any process's loss or gradient is non-finite. `logp_out` gets each micro-batch's log-probs."""
        c, world, objective = self.config, self.world, self.objective
        rows = batch.completion_ids.shape[0]
        totals = (rows * world.size, max(1.0, world.sum(float(batch.completion_mask.sum()))))
        size = c.train.micro_batch_size or rows
        starts = range(0, rows, size)
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for start in starts:
            part = slice(start, start + size)
            if world.sharded:  # reduce the gradients once, after the last micro-batch
                self.policy.set_requires_gradient_sync(start == starts[-1])
            micro = batch.rows(part)
            reference = None if ref_states is None else states_of_rows(ref_states, batch, part)
            bonus = bool(objective.entropy_coef)
            logp, token_kl, entropy = self._sampled_logprobs(micro, with_entropy, reference, entropy_grad=bonus)
            if logp_out is not None:
                logp_out.append(logp.detach())
            loss, stats = policy_loss(logp, ref_logp[part], None if old_logp is None else old_logp[part],
                                      adv.values[part], micro.completion_mask, objective, totals,
                                      None if engine_logp is None else engine_logp[part], token_kl,
                                      entropy if bonus else None)
            (loss * world.size).backward()  # FSDP averages gradients over processes; the parts must add up
            stats.update(advantage_stats(adv.rows(part)), loss=float(loss.detach()))
            if entropy is not None:
                mask = micro.completion_mask
                stats["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
            parts.append(stats)
        stats = combine_stats([s for process in world.gather(parts) for s in process])
        max_norm = c.train.grad_clip if c.train.grad_clip > 0 else float("inf")
        norm = grad_norm(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm))
        skipped = not math.isfinite(norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_row += 1
            log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                        self.step, self.nonfinite_in_row)
            if self.nonfinite_in_row >= c.train.max_nonfinite_updates:
                raise TrainingError(f"{self.nonfinite_in_row} non-finite updates in a row at step {self.step} "
                                    "(train.max_nonfinite_updates): lower train.lr or check the model's dtype")
        else:
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts updates made, not updates skipped
            self.nonfinite_in_row = 0
        stats.update(grad_norm=norm, skipped_updates=float(skipped))
        return stats

    @property
    def objective(self) -> ObjectiveConfig:
        """The objective of the next step: the run's, at the current beta (trainer.objective.kl_coefficient)."""
        return self.coefficient.objective(self.config.objective)

    def run_step(self) -> dict[str, Any]:
        c, t0, objective = self.config, time.perf_counter(), self.objective
        while len(self.pending) <= c.train.async_level:
            self.pending.append(self._generate())
        entry = self.pending.popleft()
        t_gen = time.perf_counter()
        batch = pack(entry.rollouts, self.tokenizer.pad_token_id).to(self.device)
        rewards = torch.tensor(entry.rewards, dtype=torch.float32, device=self.device)
        ref_logp, ref_states = entry.reference or self._reference(batch, full=c.objective.needs_full_kl)
        engine_logp = batch.behaviour_logp
        made = None if entry.trainer_logprobs is not None else []  # by the update's first pass
        trainer_logp = None if made is not None else token_matrix(entry.trainer_logprobs, engine_logp.shape[1])
        trainer_logp = None if trainer_logp is None else trainer_logp.to(self.device)
        # the behaviour policy as the trainer sees it: its own log-probs where it recomputes them or
        # corrects the engine with TIS (which then weights by trainer / engine), else the engine's
        tis = c.objective.tis_cap is not None
        behaviour = trainer_logp if c.rollout.recompute_logprobs or tis else engine_logp
        exactly_on_policy = c.train.async_level == 0 and c.train.minibatches == 1 and c.train.epochs == 1
        old_logp = None if exactly_on_policy else behaviour
        rows = len(entry.rollouts) // c.train.minibatches
        sampler_kl = None
        if c.objective.kl_in_reward:  # the sampler's, once per batch
            token_kl = None if entry.trainer_token_kl is None else token_matrix(entry.trainer_token_kl,
                                                                               trainer_logp.shape[1]).to(self.device)
            sampler_kl = reward_kl(objective, trainer_logp, ref_logp, batch.completion_mask, token_kl)
        updates: list[dict[str, float]] = []
        for epoch in range(c.train.epochs):
            for start in range(0, len(entry.rollouts), rows):
                part = slice(start, start + rows)
                moved = c.train.async_level > 0 or epoch > 0 or start > 0  # the policy is no longer the sampler
                minibatch = batch.rows(part)
                states = None if ref_states is None else states_of_rows(ref_states, batch, part)
                sequence_kl = sampler_kl[part] if sampler_kl is not None else None
                if sequence_kl is not None and moved and c.objective.reward_kl == "current":
                    sequence_kl = self._current_reward_kl(minibatch, ref_logp[part], states)
                adv = self._minibatch_advantages(rewards[part], sequence_kl, minibatch.completion_mask,
                                                 None if sampler_kl is None else sampler_kl[part])
                old = None if old_logp is None else old_logp[part]
                engine = engine_logp[part] if objective.needs_engine_logp else None
                updates.append(self._update(minibatch, adv, ref_logp[part], old, engine, epoch == 0, states, made))
        trainer_logp = torch.cat(made) if made is not None else trainer_logp
        mismatch = mismatch_sums(engine_logp, trainer_logp, batch.completion_mask)
        self._move_targets(batch, trainer_logp, ref_logp)
        self.engine.sync_weights()
        t_end = time.perf_counter()
        metrics = self._metrics(entry, batch, updates, mismatch, t0, t_gen, t_end)
        metrics["kl_coef"] = objective.beta
        self.step += 1
        return metrics

    def _move_targets(self, batch: PackedBatch, trainer_logp: torch.Tensor, ref_logp: torch.Tensor) -> None:
        """After a step: the adaptive beta's update, from the batch's mean per-token KL estimate under the
        policy that sampled it, as the libraries measure it (k1 stands in for `full`); and the reference's
        refresh, when due (trainer.objective.reference_refresh)."""
        objective = self.config.objective
        if self.coefficient.adaptive:
            name = "k1" if objective.needs_full_kl else objective.estimator
            mask = batch.completion_mask
            estimate = kl.estimate(name, trainer_logp, ref_logp, objective.kl_log_ratio_clamp, objective.kl_value_clamp)
            per_response = (estimate * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            responses = self.world.sum(float(per_response.numel()))
            self.coefficient.update(self.world.sum(float(per_response.sum())) / responses, int(responses))
        if reference_refresh.due(objective, self.step + 1):
            reference_refresh.refresh(self.reference, self.policy, objective.ref_refresh_alpha)
            for pending in self.pending:  # their reference passes were of the reference before
                pending.reference = None

    @torch.no_grad()
    def _current_reward_kl(self, batch: PackedBatch, ref_logp: torch.Tensor, ref_states: HeadInputs | None
                           ) -> torch.Tensor:
        """The responses' KL estimates under the policy as it is now (objective.reward_kl current), a
        micro-batch at a time."""
        size = self.config.train.micro_batch_size or batch.completion_ids.shape[0]
        parts = []
        for start in range(0, batch.completion_ids.shape[0], size):
            part = slice(start, start + size)
            micro = batch.rows(part)
            reference = None if ref_states is None else states_of_rows(ref_states, batch, part)
            logp, token_kl, _ = self._sampled_logprobs(micro, reference=reference)
            parts.append(reward_kl(self.objective, logp, ref_logp[start:start + size],
                                   micro.completion_mask, token_kl))
        return torch.cat(parts)

    def _minibatch_advantages(self, rewards: torch.Tensor, sequence_kl: torch.Tensor | None, mask: torch.Tensor,
                              centre_kl: torch.Tensor | None) -> Advantages:
        """Shaped rewards and advantages over the whole minibatch, every process's rows together (so an
        advantage that normalises over the batch sees all of it), then this process's rows. `centre_kl`: the
        sampler's KL, which a centred placement takes its group means from."""
        c, world = self.objective, self.world
        if not world.sharded:
            return batch_advantages(rewards, sequence_kl, self.config.train.group_size, c, mask, centre_kl)
        parts = (rewards, sequence_kl, mask, centre_kl)
        everyone = world.gather(tuple(None if p is None else p.cpu() for p in parts))
        rewards_all, kl_all, mask_all, centre_all = (
            None if parts[i] is None else _stack_rows([e[i] for e in everyone]).to(rewards.device) for i in range(4))
        adv = batch_advantages(rewards_all, kl_all, self.config.train.group_size, c, mask_all, centre_all)
        rows = rewards.shape[0]
        mine = adv.rows(slice(world.rank * rows, (world.rank + 1) * rows))
        if mine.values.dim() == 2:  # per-token advantages, back to this process's own width
            mine = Advantages(mine.rewards, mine.shaped, mine.values[:, :mask.shape[1]])
        return mine

    def _metrics(self, entry: PendingBatch, batch: PackedBatch, updates: list[dict[str, float]],
                 mismatch: dict[str, float], t0: float, t_gen: float, t_end: float) -> dict[str, Any]:
        """One line of metrics.jsonl: the updates' statistics (already over every process) and the
        step's rewards, lengths, counts and engine mismatch summed over the processes."""
        first_epoch = updates[: self.config.train.minibatches]
        averaged = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0] if k != "entropy"}
        averaged["entropy"] = sum(u["entropy"] for u in first_epoch) / len(first_epoch)
        averaged["skipped_updates"] = sum(u["skipped_updates"] for u in updates)
        processes = self.world.gather({
            "rewards": entry.rewards, "stops": sum(f == "stop" for f in entry.rollouts.finish_reasons),
            "generated": sum(len(t) for t in entry.rollouts.token_ids), "trained": batch.tokens,
            "verifier": dict(self.verifier.counts), "mismatch": mismatch})
        rewards = [r for p in processes for r in p["rewards"]]
        generated = sum(p["generated"] for p in processes)
        trained = sum(p["trained"] for p in processes) * self.config.train.epochs
        verifier = {k: float(sum(p["verifier"].get(k, 0) for p in processes))
                    for k in ("timeouts", "errors", "rejected")}
        mismatch_tokens = max(1.0, sum(p["mismatch"]["tokens"] for p in processes))
        return {
            "step": self.step,
            "policy_step": entry.policy_step,
            "reward_mean": sum(rewards) / len(rewards),
            "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
            **averaged,
            "lr": self.scheduler.get_last_lr()[0],
            "stop_frac": sum(p["stops"] for p in processes) / len(rewards),
            "mismatch_logp_mean": sum(p["mismatch"]["abs_sum"] for p in processes) / mismatch_tokens,
            "mismatch_logp_max": max(p["mismatch"]["abs_max"] for p in processes),
            "mismatch_kl": sum(p["mismatch"]["k3_sum"] for p in processes) / mismatch_tokens,
            "verifier_timeouts": verifier["timeouts"],
            "verifier_errors": verifier["errors"],
            "verifier_rejected": verifier["rejected"],
            "generated_tokens": generated,
            "trained_tokens": trained,
            "gen_time": t_gen - t0,
            "train_time": t_end - t_gen,
            "step_time": t_end - t0,
            "tokens_per_s": (generated + trained) / max(t_end - t0, 1e-9),
        }

    # --- the regularized objective -----------------------------------------------------------

    def _prepare_measurement(self) -> None:
        """The reference's reward histograms of the held-out prompts: read back, or sampled now while the
        policy is the reference (before the first update) and written once."""
        path = self.out / OBJECTIVE_REFERENCE
        if path.is_file():
            self.reference_record = json.loads(path.read_text())
            return
        if self.step != 0:
            raise TrainingError(f"{path} is missing: the reference's rewards are sampled before the first update; "
                                "start the run again in a new --out")
        t0 = time.perf_counter()
        try:
            self.reference_record = self.probe.reference_record(self.engine, self.verifier)
        except VerifierUnavailable as error:
            raise TrainingError(str(error)) from None
        self.reference_record["measure_time"] = time.perf_counter() - t0
        if self.world.main:
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps(self.reference_record) + "\n")
            partial.replace(path)

    def _measure(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            # at the current beta (adaptive: the beta of this step), against the reference the run started from
            line = self.probe.measure(self.step, self.engine, self.policy, self.original_reference, self.verifier,
                                      self.device, self.reference_record, beta=self.objective.beta)
        except VerifierUnavailable as error:
            raise TrainingError(str(error)) from None
        line["measure_time"] = time.perf_counter() - t0
        return line

    def _due_for_measurement(self) -> bool:
        every = self.config.measure.every
        return self.probe is not None and (self.step == self.config.train.steps or (every and self.step % every == 0))

    # --- the whole run ----------------------------------------------------------------------

    def train(self, sigterm: _SigtermFlag) -> None:
        c, main = self.config, self.world.main
        self.restore()
        if self.probe is not None and self.step < c.train.steps:
            self._prepare_measurement()
        metrics_file = (self.out / METRICS).open("a") if main else None
        bar = progress_bar(c.train.steps, "train", show=None if main else False)
        bar.update(self.step)
        try:
            if self.step < c.train.steps and self._stopping(sigterm):  # SIGTERM while loading
                raise Preempted
            while self.step < c.train.steps:
                metrics = self.run_step()
                if metrics_file is not None:
                    self.lease.check()
                    metrics_file.write(json.dumps(metrics) + "\n")
                    metrics_file.flush()
                bar.update()
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['kl_k3']:.4f}")
                if self._due_for_measurement():
                    measured = self._measure()
                    if main:
                        with (self.out / OBJECTIVE).open("a") as handle:
                            handle.write(json.dumps(measured) + "\n")
                stopping = self._stopping(sigterm)  # one collective per step
                if self.step % c.checkpoint.every == 0 or stopping:
                    self.save_checkpoint()
                if stopping and self.step < c.train.steps:
                    raise Preempted
        except Preempted:
            if self.step and self.saved_step != self.step:
                self.save_checkpoint()
            raise
        finally:
            bar.close()
            if metrics_file is not None:
                metrics_file.close()
            self.verifier.close()
        weights = full_state_dict(self.policy, prefix="lm.")
        if main:
            self.lease.check()
            save_pretrained_atomic(self.out / "final", self.lm, self.tokenizer, state_dict=weights)
            log.info("run complete: %s (final model written)", self.out)
        self.world.barrier()

    def mark_complete(self) -> None:
        """COMPLETE, the run directory's last write (after its log is closed): from now on nothing opens it."""
        if self.world.main:
            self.lease.check()
            (self.out / COMPLETE).write_text(json.dumps({"steps": self.step, "finished": time.time()}) + "\n")

    def _stopping(self, sigterm: _SigtermFlag) -> bool:
        """Whether SIGTERM reached any process: all of them must checkpoint and stop together."""
        return any(self.world.gather(sigterm.raised))


def train(config: RunConfig, out_dir: Path) -> int:
    """Run, resume or skip (if complete) the run in `out_dir`; the process exit status.

    A finished run is left exactly as it is: nothing in it is opened for writing. A run that fails
    records why in FAILED (trainer.run_files), with its log, `train.log`, which every attempt appends
    to; a trainer stopped because another one holds the directory writes nothing there."""
    out_dir = Path(out_dir)
    if (out_dir / COMPLETE).exists():
        log.info("%s is already complete; nothing to do", out_dir)
        return 0
    with _SigtermFlag() as sigterm:  # from the start: a SIGTERM during loading also ends in a clean exit
        world = World.from_environment(config.model.device)
        run, trained = None, False
        try:
            with _run_log(out_dir, world.main):
                try:
                    run = Run(config, out_dir, world)
                    run.train(sigterm)
                    trained = True
                except Preempted:
                    log.warning("preempted at step %d; checkpoint written, exiting with %d", run.step,
                                EXIT_PREEMPTED)
                    return EXIT_PREEMPTED
                except (LeaseHeld, LeaseLost, DirectoryTaken):
                    raise  # the directory is another trainer's, or another run's: nothing is recorded in it
                except Exception as error:
                    step = run.step if run is not None else None
                    where = f"at step {step}" if step is not None else "before its first step"
                    if isinstance(error, (ValueError, TrainingError)):
                        log.error("the run failed %s: %s", where, error)
                        reason = str(error)
                    else:  # a bug or a broken machine: the traceback goes into the run's log
                        log.exception("the run failed %s", where)
                        reason = f"{type(error).__name__}: {error}"
                    if world.main:
                        record_failure(out_dir, reason, step)
                    raise
                finally:
                    if run is not None:
                        run.engine.close()  # before the process group goes: vLLM tears down its groups in it
            if trained:
                run.mark_complete()
        finally:
            if run is not None:
                run.release()
            world.close()
    return 0


@contextlib.contextmanager
def _run_log(out_dir: Path, main: bool):
    """The run's own log, `<run>/train.log`: what this process logs while it trains the run, appended."""
    if not main:
        yield
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out_dir / TRAIN_LOG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    log.info("attempt started: pid %d on %s%s", os.getpid(), socket.gethostname(),
             f", SLURM job {slurm_job()}" if slurm_job() else "")
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
