"""One training step, top to bottom: rollout, reward, KL, advantages, loss, update, metrics, over one
`StepBatch` that holds the step's data from generation to loss (the rollouts packed once). Each function takes
what it uses: the batch, the policies, the `Learner` (what an update changes), the objective."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from eval.verify import Verifier
from trainer.batch import PackedBatch
from trainer.config import RunConfig, TrainConfig
from trainer.distributed import World, grad_norm
from trainer.objective import kl, reference_refresh
from trainer.objective.loss import (
    Advantages,
    LossRows,
    PolicyPass,
    advantage_stats,
    batch_advantages,
    combine_stats,
    policy_loss,
    reward_kl,
)
from trainer.objective.objective_config import ObjectiveConfig
from trainer.run.errors import TrainingError
from trainer.run.metrics import StepTimes, importance_parts, mismatch_sums, step_metrics
from trainer.run.policies import Policies
from trainer.run.producer import PendingBatch, Producer
from trainer.run.state import TrainState
from trainer.run.step_batch import StepBatch, step_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Learner:
    """What an update reads and changes: the policies, the train state (the optimizer, its schedule and the
    counters), the train settings and the process group."""

    policies: Policies
    state: TrainState
    train: TrainConfig
    world: World


def run_step(config: RunConfig, learner: Learner, producer: Producer, engine, verifier: Verifier) -> dict[str, Any]:
    """One step: the next batch, every update over it, the moving targets, the engine's new weights; the
    step's line of metrics.jsonl."""
    state, t0 = learner.state, time.perf_counter()
    objective = state.coefficient.objective(config.objective)  # at the current beta (trainer.objective.kl_coefficient)
    entry = producer.next(state)  # rollouts and rewards
    t_gen = time.perf_counter()
    sb = step_batch(entry, learner.policies, config, objective, producer.tokenizer.pad_token_id)
    updates, trainer_logp, current_logp = train_on(sb, learner, objective)
    mismatch = mismatch_sums(sb.engine_logp, trainer_logp, sb.batch.completion_mask)
    weights = importance_parts(sb.engine_logp, current_logp, sb.batch.completion_mask)
    move_targets(learner, config.objective, sb.batch, trainer_logp, sb.ref_logp, producer.pending)
    engine.sync_weights()
    times = StepTimes(t0, t_gen, time.perf_counter())
    metrics = step_metrics(sb, updates, mismatch, learner.state, learner.train, learner.world, verifier.counts, times,
                           weights)
    metrics["kl_coef"] = objective.beta
    state.step += 1
    return metrics


def train_on(sb: StepBatch, learner: Learner, objective: ObjectiveConfig
             ) -> tuple[list[dict[str, float]], torch.Tensor, torch.Tensor]:
    """Every update of the step: `train.epochs` passes over `train.minibatches` minibatches. The updates'
    statistics; the trainer's log-probs of the samples under the policy that sampled them (made by the
    first update's pass where the batch has none); and under the policy as the first epoch's updates saw
    it, the pi of the importance weights the objective applied (the step's `ess`)."""
    t = learner.train
    made = None if sb.trainer_logp is not None else []  # by the update's first pass
    current: list[torch.Tensor] = []
    rows = len(sb.entry.rollouts) // t.minibatches
    updates: list[dict[str, float]] = []
    for epoch in range(t.epochs):
        for start in range(0, len(sb.entry.rollouts), rows):
            minibatch = sb.rows(slice(start, start + rows))
            moved = t.async_level > 0 or epoch > 0 or start > 0  # the policy is no longer the sampler
            sequence_kl = minibatch.sampler_kl
            if sequence_kl is not None and moved and objective.reward_kl == "current":
                sequence_kl = current_reward_kl(learner.policies, objective, minibatch, t.micro_batch_size)
            adv = minibatch_advantages(learner.world, t.group_size, objective, minibatch, sequence_kl)
            seen: list[torch.Tensor] = []
            updates.append(update(learner, objective, minibatch, adv, with_entropy=epoch == 0, logp_out=seen))
            for kept in (made, current if epoch == 0 else None):
                if kept is not None:
                    kept.extend(seen)
    return updates, torch.cat(made) if made is not None else sb.trainer_logp, torch.cat(current)


@torch.no_grad()
def current_reward_kl(policies: Policies, objective: ObjectiveConfig, minibatch: StepBatch,
                      micro_batch_size: int) -> torch.Tensor:
    """The responses' KL estimates under the policy as it is now (objective.reward_kl current), a
    micro-batch at a time."""
    rows = minibatch.batch.completion_ids.shape[0]
    size = micro_batch_size or rows
    parts = []
    for start in range(0, rows, size):
        micro = minibatch.rows(slice(start, start + size))
        logp, token_kl, _ = policies.sampled_logprobs(micro.batch, reference=micro.ref_states)
        parts.append(reward_kl(objective, logp, micro.ref_logp, micro.batch.completion_mask, token_kl))
    return torch.cat(parts)


def _stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-response values [B] or per-token ones [B_i, T_i] of several processes, as one batch (per-token
    rows padded with 0 to the widest: each process packs its own completions)."""
    if parts[0].dim() == 1:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def minibatch_advantages(world: World, group_size: int, objective: ObjectiveConfig, minibatch: StepBatch,
                         sequence_kl: torch.Tensor | None) -> Advantages:
    """Shaped rewards and advantages over the whole minibatch, every process's rows together (so an
    advantage that normalises over the batch sees all of it), then this process's rows. The sampler's KL
    (`minibatch.sampler_kl`) is what a centred placement takes its group means from."""
    rewards, mask, centre_kl = minibatch.rewards, minibatch.batch.completion_mask, minibatch.sampler_kl
    if not world.sharded:
        return batch_advantages(rewards, sequence_kl, group_size, objective, mask, centre_kl)
    parts = (rewards, sequence_kl, mask, centre_kl)
    everyone = world.gather(tuple(None if p is None else p.cpu() for p in parts))
    rewards_all, kl_all, mask_all, centre_all = (
        None if parts[i] is None else _stack_rows([e[i] for e in everyone]).to(rewards.device) for i in range(4))
    adv = batch_advantages(rewards_all, kl_all, group_size, objective, mask_all, centre_all)
    rows = rewards.shape[0]
    mine = adv.rows(slice(world.rank * rows, (world.rank + 1) * rows))
    if mine.values.dim() == 2:  # per-token advantages, back to this process's own width
        mine = Advantages(mine.rewards, mine.shaped, mine.values[:, :mask.shape[1]])
    return mine


def update(learner: Learner, objective: ObjectiveConfig, minibatch: StepBatch, adv: Advantages, with_entropy: bool,
           logp_out: list[torch.Tensor] | None = None) -> dict[str, float]:
    """One optimizer update on this process's part of a minibatch (whole groups, whose advantages
    `adv` were computed over the whole minibatch), a micro-batch at a time; skipped everywhere if
    any process's loss or gradient is non-finite. `logp_out` gets each micro-batch's log-probs."""
    world, state, policy = learner.world, learner.state, learner.policies.policy
    mask = minibatch.batch.completion_mask
    rows = mask.shape[0]
    totals = (rows * world.size, max(1.0, world.sum(float(mask.sum()))))
    size = learner.train.micro_batch_size or rows
    starts = range(0, rows, size)
    state.optimizer.zero_grad(set_to_none=True)
    parts = []
    for start in starts:
        part = slice(start, start + size)
        if world.sharded:  # reduce the gradients once, after the last micro-batch
            policy.set_requires_gradient_sync(start == starts[-1])
        micro = minibatch.rows(part)
        loss, stats = micro_loss(learner.policies, objective, micro, adv.rows(part), with_entropy, totals, logp_out)
        (loss * world.size).backward()  # FSDP averages gradients over processes; the parts must add up
        parts.append(stats)
    stats = combine_stats([s for process in world.gather(parts) for s in process])
    stats.update(step_optimizer(learner, policy))
    return stats


def micro_loss(policies: Policies, objective: ObjectiveConfig, micro: StepBatch, adv: Advantages, with_entropy: bool,
               totals: tuple[float, float], logp_out: list[torch.Tensor] | None) -> tuple[torch.Tensor, dict]:
    """One micro-batch's share of the minibatch's loss, from one pass of the policy, with its statistics."""
    bonus = bool(objective.entropy_coef)
    logp, token_kl, entropy = policies.sampled_logprobs(micro.batch, with_entropy, micro.ref_states,
                                                        entropy_grad=bonus)
    if logp_out is not None:
        logp_out.append(logp.detach())
    engine = micro.engine_logp if objective.needs_engine_logp else None
    rows = LossRows(micro.ref_logp, micro.batch.completion_mask, adv.values, micro.old_logp, engine,
                    micro.batch.prompt_lengths)
    loss, stats = policy_loss(PolicyPass(logp, token_kl, entropy if bonus else None), rows, objective, totals=totals)
    stats.update(advantage_stats(adv), loss=float(loss.detach()))
    if entropy is not None:
        mask = micro.batch.completion_mask
        stats["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
    return loss, stats


def step_optimizer(learner: Learner, policy: torch.nn.Module) -> dict[str, float]:
    """The optimizer's step after the gradients are in, clipped; skipped (and counted) if they are not finite."""
    state, t = learner.state, learner.train
    max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
    norm = grad_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm))
    skipped = not math.isfinite(norm)
    if skipped:
        state.optimizer.zero_grad(set_to_none=True)
        state.nonfinite_in_row += 1
        log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                    state.step, state.nonfinite_in_row)
        if state.nonfinite_in_row >= t.max_nonfinite_updates:
            raise TrainingError(f"{state.nonfinite_in_row} non-finite updates in a row at step {state.step} "
                                "(train.max_nonfinite_updates): lower train.lr or check the model's dtype")
    else:
        state.optimizer.step()
        state.scheduler.step()  # the schedule counts updates made, not updates skipped
        state.nonfinite_in_row = 0
    return {"grad_norm": norm, "skipped_updates": float(skipped)}


def move_targets(learner: Learner, objective: ObjectiveConfig, batch: PackedBatch, trainer_logp: torch.Tensor,
                 ref_logp: torch.Tensor, pending: deque[PendingBatch]) -> None:
    """After a step: the adaptive beta's update, from the batch's mean per-token KL estimate under the
    policy that sampled it, as the libraries measure it (k1 stands in for `full`); and the reference's
    refresh, when due (trainer.objective.reference_refresh), which drops the `pending` batches' reference
    passes."""
    state, world = learner.state, learner.world
    if state.coefficient.adaptive:
        name = "k1" if objective.needs_full_kl else objective.estimator
        mask = batch.completion_mask
        estimate = kl.estimate(name, trainer_logp, ref_logp, objective.kl_log_ratio_clamp, objective.kl_value_clamp)
        per_response = (estimate * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        responses = world.sum(float(per_response.numel()))
        state.coefficient.update(world.sum(float(per_response.sum())) / responses, int(responses))
    if reference_refresh.due(objective, state.step + 1):
        policies = learner.policies
        reference_refresh.refresh(policies.reference, policies.policy, objective.ref_refresh_alpha)
        for entry in pending:  # their reference passes were of the reference before
            entry.reference = None
