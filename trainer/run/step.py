"""One training step, top to bottom: rollout, reward, KL, advantages, loss, update, metrics, over one
`StepBatch` that holds the step's data from generation to loss (the rollouts packed once)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.distributed import grad_norm
from trainer.model.logprobs import PackedBatch, pack, states_of_rows, token_matrix
from trainer.objective import kl, reference_refresh
from trainer.objective.full_kl import HeadInputs
from trainer.objective.loss import Advantages, advantage_stats, batch_advantages, combine_stats, policy_loss, reward_kl
from trainer.objective.objective_config import ObjectiveConfig
from trainer.run.errors import TrainingError
from trainer.run.metrics import mismatch_sums, step_metrics
from trainer.run.producer import PendingBatch

if TYPE_CHECKING:
    from trainer.run.loop import Run

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """A step's data, from the rollouts to the loss. [B, T] tensors of this process's rows, except rewards [B].

    trainer_logp  the trainer's log-probs of the samples under the policy that sampled them, or None where
                  the update's first pass makes them (`Producer.update_makes_trainer_logprobs`)
    old_logp      the behaviour policy of the importance ratio, or None exactly on policy
    sampler_kl    each response's KL in the reward, under the sampler (None without a KL in the reward)
    """

    entry: PendingBatch
    batch: PackedBatch
    rewards: torch.Tensor
    ref_logp: torch.Tensor
    ref_states: HeadInputs | None
    engine_logp: torch.Tensor
    trainer_logp: torch.Tensor | None
    old_logp: torch.Tensor | None
    sampler_kl: torch.Tensor | None


def step_batch(run: "Run", entry: PendingBatch, objective: ObjectiveConfig) -> StepBatch:
    c, policies = run.config, run.policies
    device = policies.device
    batch = entry.packed if entry.packed is not None else pack(entry.rollouts, run.tokenizer.pad_token_id).to(device)
    rewards = torch.tensor(entry.rewards, dtype=torch.float32, device=device)
    ref_logp, ref_states = entry.reference or policies.reference_pass(batch, full=c.objective.needs_full_kl)
    engine_logp = batch.behaviour_logp
    trainer_logp = None
    if entry.trainer_logprobs is not None:
        trainer_logp = token_matrix(entry.trainer_logprobs, engine_logp.shape[1]).to(device)
    # the behaviour policy as the trainer sees it: its own log-probs where it recomputes them or
    # corrects the engine with TIS (which then weights by trainer / engine), else the engine's
    tis = c.objective.tis_cap is not None
    behaviour = trainer_logp if c.rollout.recompute_logprobs or tis else engine_logp
    exactly_on_policy = c.train.async_level == 0 and c.train.minibatches == 1 and c.train.epochs == 1
    sampler_kl = None
    if c.objective.kl_in_reward:  # the sampler's, once per batch
        token_kl = None if entry.trainer_token_kl is None else token_matrix(entry.trainer_token_kl,
                                                                           trainer_logp.shape[1]).to(device)
        sampler_kl = reward_kl(objective, trainer_logp, ref_logp, batch.completion_mask, token_kl)
    return StepBatch(entry, batch, rewards, ref_logp, ref_states, engine_logp, trainer_logp,
                     None if exactly_on_policy else behaviour, sampler_kl)


def run_step(run: "Run") -> dict[str, Any]:
    c, state, t0 = run.config, run.state, time.perf_counter()
    objective = state.coefficient.objective(c.objective)  # at the current beta (trainer.objective.kl_coefficient)
    entry = run.producer.next(state)  # rollouts and rewards
    t_gen = time.perf_counter()
    sb = step_batch(run, entry, objective)  # the reference's pass, the sampler's KL
    made = None if sb.trainer_logp is not None else []  # by the update's first pass
    rows = len(entry.rollouts) // c.train.minibatches
    updates: list[dict[str, float]] = []
    for epoch in range(c.train.epochs):
        for start in range(0, len(entry.rollouts), rows):
            part = slice(start, start + rows)
            moved = c.train.async_level > 0 or epoch > 0 or start > 0  # the policy is no longer the sampler
            minibatch = sb.batch.rows(part)
            states = None if sb.ref_states is None else states_of_rows(sb.ref_states, sb.batch, part)
            sequence_kl = sb.sampler_kl[part] if sb.sampler_kl is not None else None
            if sequence_kl is not None and moved and c.objective.reward_kl == "current":
                sequence_kl = current_reward_kl(run, objective, minibatch, sb.ref_logp[part], states)
            adv = minibatch_advantages(run, objective, sb.rewards[part], sequence_kl, minibatch.completion_mask,
                                       None if sb.sampler_kl is None else sb.sampler_kl[part])
            old = None if sb.old_logp is None else sb.old_logp[part]
            engine = sb.engine_logp[part] if objective.needs_engine_logp else None
            updates.append(update(run, objective, minibatch, adv, sb.ref_logp[part], old, engine,
                                  with_entropy=epoch == 0, ref_states=states, logp_out=made))
    trainer_logp = torch.cat(made) if made is not None else sb.trainer_logp
    mismatch = mismatch_sums(sb.engine_logp, trainer_logp, sb.batch.completion_mask)
    move_targets(run, sb.batch, trainer_logp, sb.ref_logp)
    run.engine.sync_weights()
    t_end = time.perf_counter()
    metrics = step_metrics(run, sb, updates, mismatch, t0, t_gen, t_end)
    metrics["kl_coef"] = objective.beta
    state.step += 1
    return metrics


@torch.no_grad()
def current_reward_kl(run: "Run", objective: ObjectiveConfig, batch: PackedBatch, ref_logp: torch.Tensor,
                      ref_states: HeadInputs | None) -> torch.Tensor:
    """The responses' KL estimates under the policy as it is now (objective.reward_kl current), a
    micro-batch at a time."""
    size = run.config.train.micro_batch_size or batch.completion_ids.shape[0]
    parts = []
    for start in range(0, batch.completion_ids.shape[0], size):
        part = slice(start, start + size)
        micro = batch.rows(part)
        reference = None if ref_states is None else states_of_rows(ref_states, batch, part)
        logp, token_kl, _ = run.policies.sampled_logprobs(micro, reference=reference)
        parts.append(reward_kl(objective, logp, ref_logp[start:start + size], micro.completion_mask, token_kl))
    return torch.cat(parts)


def _stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-response values [B] or per-token ones [B_i, T_i] of several processes, as one batch (per-token
    rows padded with 0 to the widest: each process packs its own completions)."""
    if parts[0].dim() == 1:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def minibatch_advantages(run: "Run", objective: ObjectiveConfig, rewards: torch.Tensor,
                         sequence_kl: torch.Tensor | None, mask: torch.Tensor, centre_kl: torch.Tensor | None
                         ) -> Advantages:
    """Shaped rewards and advantages over the whole minibatch, every process's rows together (so an
    advantage that normalises over the batch sees all of it), then this process's rows. `centre_kl`: the
    sampler's KL, which a centred placement takes its group means from."""
    world, group = run.world, run.config.train.group_size
    if not world.sharded:
        return batch_advantages(rewards, sequence_kl, group, objective, mask, centre_kl)
    parts = (rewards, sequence_kl, mask, centre_kl)
    everyone = world.gather(tuple(None if p is None else p.cpu() for p in parts))
    rewards_all, kl_all, mask_all, centre_all = (
        None if parts[i] is None else _stack_rows([e[i] for e in everyone]).to(rewards.device) for i in range(4))
    adv = batch_advantages(rewards_all, kl_all, group, objective, mask_all, centre_all)
    rows = rewards.shape[0]
    mine = adv.rows(slice(world.rank * rows, (world.rank + 1) * rows))
    if mine.values.dim() == 2:  # per-token advantages, back to this process's own width
        mine = Advantages(mine.rewards, mine.shaped, mine.values[:, :mask.shape[1]])
    return mine


def update(run: "Run", objective: ObjectiveConfig, batch: PackedBatch, adv: Advantages, ref_logp: torch.Tensor,
           old_logp: torch.Tensor | None, engine_logp: torch.Tensor | None, with_entropy: bool,
           ref_states: HeadInputs | None = None, logp_out: list[torch.Tensor] | None = None) -> dict[str, float]:
    """One optimizer update on this process's part of a minibatch (whole groups, whose advantages
    `adv` were computed over the whole minibatch), a micro-batch at a time; skipped everywhere if
    any process's loss or gradient is non-finite. `logp_out` gets each micro-batch's log-probs."""
    c, world, state, policy = run.config, run.world, run.state, run.policies.policy
    rows = batch.completion_ids.shape[0]
    totals = (rows * world.size, max(1.0, world.sum(float(batch.completion_mask.sum()))))
    size = c.train.micro_batch_size or rows
    starts = range(0, rows, size)
    state.optimizer.zero_grad(set_to_none=True)
    parts = []
    for start in starts:
        part = slice(start, start + size)
        if world.sharded:  # reduce the gradients once, after the last micro-batch
            policy.set_requires_gradient_sync(start == starts[-1])
        micro = batch.rows(part)
        reference = None if ref_states is None else states_of_rows(ref_states, batch, part)
        bonus = bool(objective.entropy_coef)
        logp, token_kl, entropy = run.policies.sampled_logprobs(micro, with_entropy, reference, entropy_grad=bonus)
        if logp_out is not None:
            logp_out.append(logp.detach())
        loss, stats = policy_loss(logp, ref_logp[part], None if old_logp is None else old_logp[part],
                                  adv.values[part], micro.completion_mask, objective, totals=totals,
                                  engine_logp=None if engine_logp is None else engine_logp[part], token_kl=token_kl,
                                  entropy=entropy if bonus else None, prompt_lengths=micro.prompt_lengths)
        (loss * world.size).backward()  # FSDP averages gradients over processes; the parts must add up
        stats.update(advantage_stats(adv.rows(part)), loss=float(loss.detach()))
        if entropy is not None:
            mask = micro.completion_mask
            stats["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        parts.append(stats)
    stats = combine_stats([s for process in world.gather(parts) for s in process])
    max_norm = c.train.grad_clip if c.train.grad_clip > 0 else float("inf")
    norm = grad_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm))
    skipped = not math.isfinite(norm)
    if skipped:
        state.optimizer.zero_grad(set_to_none=True)
        state.nonfinite_in_row += 1
        log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                    state.step, state.nonfinite_in_row)
        if state.nonfinite_in_row >= c.train.max_nonfinite_updates:
            raise TrainingError(f"{state.nonfinite_in_row} non-finite updates in a row at step {state.step} "
                                "(train.max_nonfinite_updates): lower train.lr or check the model's dtype")
    else:
        state.optimizer.step()
        state.scheduler.step()  # the schedule counts updates made, not updates skipped
        state.nonfinite_in_row = 0
    stats.update(grad_norm=norm, skipped_updates=float(skipped))
    return stats


def move_targets(run: "Run", batch: PackedBatch, trainer_logp: torch.Tensor, ref_logp: torch.Tensor) -> None:
    """After a step: the adaptive beta's update, from the batch's mean per-token KL estimate under the
    policy that sampled it, as the libraries measure it (k1 stands in for `full`); and the reference's
    refresh, when due (trainer.objective.reference_refresh)."""
    objective, state = run.config.objective, run.state
    if state.coefficient.adaptive:
        name = "k1" if objective.needs_full_kl else objective.estimator
        mask = batch.completion_mask
        estimate = kl.estimate(name, trainer_logp, ref_logp, objective.kl_log_ratio_clamp, objective.kl_value_clamp)
        per_response = (estimate * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        responses = run.world.sum(float(per_response.numel()))
        state.coefficient.update(run.world.sum(float(per_response.sum())) / responses, int(responses))
    if reference_refresh.due(objective, state.step + 1):
        reference_refresh.refresh(run.policies.reference, run.policies.policy, objective.ref_refresh_alpha)
        for pending in run.producer.pending:  # their reference passes were of the reference before
            pending.reference = None
