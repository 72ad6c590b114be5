"""The RL loss: policy gradient plus a KL term, for every estimator x placement x weighting.

docs/concepts/theory.md, "What each configuration differentiates", states what each configuration's
expected gradient is; `trainer.audits.audit` checks these statements by exact enumeration through
`compute_loss` itself, so the trainer and the proof share one implementation.

Two phases: `batch_advantages` shapes the rewards and computes the advantages once per minibatch,
over all its rows; `policy_loss` then computes the loss of any part of it (a micro-batch on one
process). `compute_loss` is both at once, for one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.objective import advantages, kl, loss_aggs, pg_terms, placements, whitening
from trainer.objective.engine_weights import engine_weights
from trainer.objective.kl_terms import centred_kl, kl_loss_term, kl_loss_weight, kl_reward_span, reward_kl
from trainer.objective.objective_config import ObjectiveConfig

__all__ = ["Advantages", "LossRows", "ObjectiveConfig", "PolicyPass", "advantage_stats",
           "aggregate", "batch_advantages", "combine_stats", "compute_loss", "policy_loss", "reward_kl"]

# How combine_stats pools each statistic over a batch's parts (micro-batches, processes):
# a part's share of the whole batch's (with `totals`) adds up;
SUMMED_STATS = ("loss", "loss_pg", "loss_kl", "loss_kl_behaviour", "loss_entropy", "kl_clamped_tokens")
# a mean over response tokens is weighted by the part's tokens (`_tokens`); every other mean, over
# rows, by its rows (`_rows`); adv_std is pooled from the parts' means and mean squares. Keys that
# start with "_" are these weights: combine_stats consumes them.
TOKEN_MEAN_STATS = ("ratio_mean", "clip_frac", "dual_clip_frac", "entropy", "tis_weight_mean", "tis_truncated_frac",
                    "seq_ratio_truncated_frac", "ratio_bounded_frac")


def aggregate(per_token: Tensor, mask: Tensor, loss_agg: str, norm_length: int | None = None,
              totals: tuple[float, float] | None = None, prompt_lengths: Tensor | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss over the response `mask` as `loss_agg` says (trainer.objective.loss_aggs).

    `totals` = (rows, tokens) of the whole batch these rows are a part of (all micro-batches, all
    processes). Means then divide by those, so the parts' losses add up to the whole batch's loss,
    and their gradients to its gradient, exactly. `prompt_lengths` [B]: each row's prompt tokens, for an
    aggregation that reads them (`needs_prompt_lengths`)."""
    masked = per_token * mask
    rows, tokens = totals if totals is not None else (mask.shape[0], mask.sum().clamp(min=1))
    spec = loss_aggs.REGISTRY[loss_agg]
    if not spec.needs_prompt_lengths:
        return spec.reduce(masked, mask, rows, tokens, norm_length)
    if prompt_lengths is None:
        raise ValueError(f"loss_agg {loss_agg}: aggregate needs prompt_lengths, the tokens of each row's prompt")
    return spec.reduce(masked, mask, rows, tokens, norm_length, prompt_lengths=prompt_lengths)


def _check_inputs(logp: Tensor, per_response: dict[str, Tensor], group_size: int | None,
                  **named: Tensor | None) -> None:
    """`named` tensors are [B, T] like logp; `per_response` ones (rewards, advantages) are [B]."""
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape [B, T], got {tuple(logp.shape)}")
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logp has {tuple(logp.shape)}")
    for name, tensor in per_response.items():
        if tensor.shape != logp.shape[:1]:
            raise ValueError(f"{name} must have shape [{logp.shape[0]}], got {tuple(tensor.shape)}")
    if group_size is not None and (group_size < 1 or logp.shape[0] % group_size):
        raise ValueError(f"batch of {logp.shape[0]} rows is not a whole number of groups of {group_size}")


@dataclass(frozen=True)
class Advantages:
    """A minibatch's rewards, shaped with the KL when it goes in the reward, and their advantages."""

    rewards: Tensor  # [B]
    shaped: Tensor   # [B]
    values: Tensor   # [B], or [B, T] with the KL in per-token rewards

    def rows(self, index: slice) -> "Advantages":
        return Advantages(self.rewards[index], self.shaped[index], self.values[index])


def batch_advantages(rewards: Tensor, sequence_kl: Tensor | None, group_size: int, config: ObjectiveConfig,
                     mask: Tensor | None = None, centre_kl: Tensor | None = None) -> Advantages:
    """Shape the rewards (minus beta x `sequence_kl` where the KL goes in the reward) and compute the
    advantages, over all the rows an advantage estimator reads: call it once per minibatch, with every
    row of it (a "batch"-scope estimator normalises over them all), then `policy_loss` per part.

    With the KL in per-token rewards (`sequence_kl` [B, T], from `reward_kl`), the rewards go through the
    advantage estimator alone and each token's advantage is that minus beta x the KL its score reaches
    (trainer.objective.placements), with no baseline: as the PPO-style libraries return per-token KL rewards.
    With the KL centred (placement reward-centred) the same, each response's KL minus the mean over its group
    of `centre_kl` (the sampler's KL; `sequence_kl` itself when not given). A whitening estimator then whitens
    the combined values over the response tokens of `mask` [B, T] (required for it): [B, T] advantages."""
    rewards = rewards.detach()
    spec = advantages.REGISTRY[config.advantage]
    if spec.whiten is not None and mask is None:
        raise ValueError(f"advantage {config.advantage}: batch_advantages needs the response mask to whiten over")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    if config.kl_in_reward:
        if sequence_kl is None:
            raise ValueError(f"placement {config.placement}: batch_advantages needs the responses' KL (reward_kl)")
        token_kl = sequence_kl.detach()
        expected = 2 if config.kl_in_token_rewards else 1
        if token_kl.dim() != expected:
            shape = "are per token, [B, T]" if expected == 2 else "are per response, [B]"
            raise ValueError(f"placement {config.placement}: the KL rewards {shape}, got {tuple(token_kl.shape)}")
        shaped = rewards.to(token_kl.dtype) - config.beta * (token_kl.sum(-1) if expected == 2 else token_kl)
        if config.kl_in_token_rewards or placements.REGISTRY[config.placement].centred:
            base = advantages.compute(config.advantage, rewards.to(token_kl.dtype), group_size,
                                      grpo_scale=config.grpo_scale)
            if config.kl_in_token_rewards:
                values = base.unsqueeze(-1) - config.beta * kl_reward_span(token_kl, config)
            else:
                centre = token_kl if centre_kl is None else centre_kl.detach().to(token_kl.dtype)
                values = base - config.beta * centred_kl(token_kl, centre, group_size)
            return Advantages(rewards, shaped, _whitened(values, mask, spec))
    else:
        shaped = rewards.to(dtype)
    values = advantages.compute(config.advantage, shaped, group_size, grpo_scale=config.grpo_scale)
    return Advantages(rewards, shaped, _whitened(values, mask, spec))


def _whitened(values: Tensor, mask: Tensor | None, spec: advantages.Advantage) -> Tensor:
    return values if spec.whiten is None else whitening.whiten(values, mask.to(values.dtype), spec.whiten)


def compute_loss(
    logp: Tensor,
    ref_logp: Tensor,
    old_logp: Tensor | None,
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    config: ObjectiveConfig,
    totals: tuple[float, float] | None = None,
    engine_logp: Tensor | None = None,
    token_kl: Tensor | None = None,
    old_token_kl: Tensor | None = None,
    entropy: Tensor | None = None,
    stats: bool = True,
    prompt_lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The scalar loss to minimise and a dict of plain-float statistics, for one whole batch:
    `batch_advantages` then `policy_loss` (the trainer calls those two itself, so that advantages
    are computed once per minibatch and the loss per micro-batch).

    logp      [B, T] log pi_theta of the sampled tokens (with grad)
    ref_logp  [B, T] log pi_ref of the same tokens
    old_logp  [B, T] log mu, the behaviour policy that sampled them; None means on-policy
              (mu = pi_theta, detached)
    rewards   [B]    scalar reward per response
    mask      [B, T] 1 on response tokens, 0 on padding
    B = prompts x group_size, each group in consecutive rows.
    totals    (rows, tokens) of the whole batch when these rows are one part of it (see `aggregate`);
              the part's loss and loss statistics are then its share of the whole batch's.
    engine_logp  [B, T] log-probs the rollout engine sampled with, for config.tis_cap (importance
              weights of the policy-gradient term from the engine to the trainer's policy,
              trainer.objective.engine_weights) and kl_loss_ratio engine; ignored by the others
    token_kl  [B, T] the exact KL(pi_theta || pi_ref) over the vocabulary at each position (with
              grad; trainer.objective.full_kl), for estimator `full`; old_token_kl the same of mu, for its
              reward when reward_kl is "sampler" and old_logp is given
    entropy   [B, T] the exact entropy of each position's next-token distribution (with grad), for
              config.entropy_coef > 0
    stats     False: no statistics (an empty dict), for callers that only differentiate the loss (the
              audits call it tens of thousands of times; the statistics were over a third of their time)
    prompt_lengths  [B] the tokens of each row's prompt, for an aggregation that divides by the whole
              sequence's length (config.needs_prompt_lengths); ignored by the others

    The KL in the reward is computed from mu's log-probs (config.reward_kl "sampler", when old_logp
    is given) or from pi_theta's ("current").
    """
    _check_inputs(logp, {"rewards": rewards}, group_size, ref_logp=ref_logp, mask=mask, old_logp=old_logp,
                  engine_logp=engine_logp, token_kl=token_kl, old_token_kl=old_token_kl)
    sequence_kl = centre_kl = None
    if config.kl_in_reward:
        sampler = old_logp is not None and config.reward_kl == "sampler"
        sequence_kl = reward_kl(config, old_logp if sampler else logp, ref_logp, mask,
                                old_token_kl if sampler else token_kl)
        if placements.REGISTRY[config.placement].centred and old_logp is not None and not sampler:
            centre_kl = reward_kl(config, old_logp, ref_logp, mask, old_token_kl)  # the group means: the sampler's
    adv = batch_advantages(rewards, sequence_kl, group_size, config, mask, centre_kl)
    loss, loss_stats = policy_loss(PolicyPass(logp, token_kl, entropy),
                                   LossRows(ref_logp, mask, adv.values, old_logp, engine_logp, prompt_lengths),
                                   config, totals, stats)
    return loss, {**loss_stats, **advantage_stats(adv)} if stats else {}


@dataclass(frozen=True)
class PolicyPass:
    """What the policy's pass over some rows gives ([B, T] each, 0 on padding): log pi_theta of the sampled
    tokens, with grad; the exact token KL to the reference (estimator full) and each position's entropy
    with its gradient (objective.entropy_coef), where the objective needs them."""

    logp: Tensor
    token_kl: Tensor | None = None
    entropy: Tensor | None = None


@dataclass(frozen=True)
class LossRows:
    """The rows a loss is computed over, as the batch gives them (`compute_loss` says what each holds):
    the reference's log-probs, the response mask, the advantages ([B], or [B, T] with per-token KL
    rewards); the behaviour policy's and the engine's log-probs and the prompts' lengths where needed."""

    ref_logp: Tensor
    mask: Tensor
    adv: Tensor
    old_logp: Tensor | None = None
    engine_logp: Tensor | None = None
    prompt_lengths: Tensor | None = None


def policy_loss(current: PolicyPass, rows: LossRows, config: ObjectiveConfig,
                totals: tuple[float, float] | None = None, stats: bool = True) -> tuple[Tensor, dict[str, float]]:
    """The loss of some rows given their advantages (from `batch_advantages`): the policy-gradient term,
    beta x the KL term where the KL goes in the loss (to the reference, to mu, or both: objective.kl_to), and
    minus entropy_coef x the entropy; with the loss statistics (none if not `stats`). `totals` and `stats` are
    `compute_loss`'s."""
    logp, token_kl, entropy = current.logp, current.token_kl, current.entropy
    ref_logp, mask, adv, old_logp = rows.ref_logp, rows.mask, rows.adv, rows.old_logp
    engine_logp, prompt_lengths = rows.engine_logp, rows.prompt_lengths
    per_token = {"adv": adv} if adv.dim() == 2 else {}
    per_response = {} if per_token else {"adv": adv}
    if prompt_lengths is not None:
        per_response["prompt_lengths"] = prompt_lengths
    _check_inputs(logp, per_response, None, ref_logp=ref_logp, mask=mask, old_logp=old_logp,
                  engine_logp=engine_logp, token_kl=token_kl, entropy=entropy, **per_token)
    if config.needs_engine_logp and engine_logp is None:
        key = "tis_cap" if config.tis_cap is not None else "kl_loss_ratio"
        raise ValueError(f"objective.{key}: compute_loss needs engine_logp, the engine's own log-probs")
    if config.needs_prompt_lengths and prompt_lengths is None:
        key = "loss_agg" if loss_aggs.REGISTRY[config.loss_agg].needs_prompt_lengths else "kl_loss_agg"
        raise ValueError(f"objective.{key}: compute_loss needs prompt_lengths, the tokens of each row's prompt")
    if config.entropy_coef and entropy is None:
        raise ValueError("objective.entropy_coef: compute_loss needs entropy, each position's entropy (with grad)")
    dtype = kl.compute_dtype(logp, ref_logp)
    maskf = mask.to(dtype)
    logp_c = logp.to(dtype)
    old = logp_c.detach() if old_logp is None else old_logp.to(dtype)

    ratio = torch.exp(logp_c - old)
    adv_t = adv.to(dtype) if adv.dim() == 2 else adv.to(dtype).unsqueeze(-1)
    sequence = pg_terms.sequence_ratios(logp_c, old, maskf, config) if config.reads_sequence_ratios else None
    term = pg_terms.policy_gradient(logp_c, old, adv_t, maskf, config, None if sequence is None else sequence[0])
    pg, clipped, dual_clipped = term.per_token, term.clipped, term.dual_clipped
    tis = None
    if config.tis_cap is not None:
        # weights of old / mu_engine: non-negative constants per token, so they scale the clipped term as is
        tis = engine_weights(old, engine_logp, maskf, config)
        pg = tis.weights * pg
    loss_pg = aggregate(pg, maskf, config.loss_agg, config.norm_length, totals, prompt_lengths)

    loss = loss_pg
    loss_kl = torch.zeros((), dtype=dtype, device=logp.device)
    loss_kl_behaviour = torch.zeros((), dtype=dtype, device=logp.device)
    weight = kl_loss_weight(config, logp_c, ratio, sequence, engine_logp) if config.any_kl_in_loss else None
    kl_agg = config.kl_loss_agg or config.loss_agg
    if config.reference_kl_in_loss:
        kl_term = kl_loss_term(config, logp, ref_logp, token_kl, weight)
        loss_kl = config.beta * aggregate(kl_term, maskf, kl_agg, config.norm_length, totals, prompt_lengths)
        loss = loss + loss_kl
    if config.behaviour_kl_beta is not None:  # toward mu (pi itself, detached, exactly on-policy): kl_to
        kl_term = kl_loss_term(config, logp, old, None, weight, config.behaviour_kl_estimator)
        loss_kl_behaviour = config.behaviour_kl_beta * aggregate(kl_term, maskf, kl_agg, config.norm_length, totals,
                                                                 prompt_lengths)
        loss = loss + loss_kl_behaviour
    loss_entropy = torch.zeros((), dtype=dtype, device=logp.device)
    if config.entropy_coef:
        loss_entropy = -config.entropy_coef * aggregate(entropy.to(dtype), maskf, config.loss_agg, config.norm_length,
                                                        totals, prompt_lengths)
        loss = loss + loss_entropy

    if not stats:
        return loss, {}
    found = _stats(logp_c, ref_logp, ratio, clipped, maskf, loss_pg, loss_kl, config, token_kl)
    found["loss_entropy"] = float(loss_entropy.detach())
    if config.behaviour_kl_beta is not None:
        found["loss_kl_behaviour"] = float(loss_kl_behaviour.detach())
    if dual_clipped is not None:
        found["dual_clip_frac"] = float((dual_clipped & maskf.bool()).sum() / maskf.sum().clamp(min=1))
    if tis is not None:
        found.update(_tis_stats(tis, maskf))
    if sequence is not None:
        found.update(_sequence_stats(*sequence, maskf, config.sequence_ratio_cap))
    if term.bounded is not None:
        found["ratio_bounded_frac"] = float((term.bounded & maskf.bool()).sum() / maskf.sum().clamp(min=1))
    return loss, found


@torch.no_grad()
def _stats(logp: Tensor, ref_logp: Tensor, ratio: Tensor, clipped: Tensor, maskf: Tensor, loss_pg: Tensor,
           loss_kl: Tensor, config: ObjectiveConfig, token_kl: Tensor | None) -> dict[str, float]:
    """Plain floats for logging, gathered in one device transfer: the responses' KL by every
    sampled-token estimator (kl_k1, ...), and by `full` where the exact token KL was computed."""
    n_tokens = maskf.sum().clamp(min=1)
    sequence_kls = {f"kl_{name}": (kl.estimate(name, logp.detach(), ref_logp) * maskf).sum(dim=-1)
                    for name in kl.logged_estimators()}
    if token_kl is not None:
        sequence_kls["kl_full"] = (token_kl.detach().to(maskf.dtype) * maskf).sum(dim=-1)
    tokens = maskf.bool()
    ratio_tokens = ratio.detach()[tokens] if tokens.any() else ratio.new_ones(1)
    clamped_tokens = torch.zeros((), dtype=maskf.dtype, device=maskf.device)
    if config.placement != "none" and not config.needs_full_kl:
        clamped_tokens = (kl.clamped(config.estimator, logp, ref_logp, config.kl_log_ratio_clamp, config.kl_value_clamp)
                          & tokens).sum().to(maskf.dtype)
    values = {
        **{name: per_row.mean() for name, per_row in sequence_kls.items()},
        "ratio_mean": ratio_tokens.mean(),
        "ratio_min": ratio_tokens.min(),
        "ratio_max": ratio_tokens.max(),
        "clip_frac": (clipped & tokens).sum() / n_tokens,
        "kl_clamped_tokens": clamped_tokens,
        "loss_pg": loss_pg.detach(),
        "loss_kl": loss_kl.detach(),
        "response_length": maskf.sum(dim=-1).mean(),
        "_rows": maskf.new_tensor(float(maskf.shape[0])),  # combine_stats' weights
        "_tokens": maskf.sum(),
    }
    numbers = torch.stack([v.to(maskf.dtype) for v in values.values()]).tolist()
    return dict(zip(values, numbers, strict=True))


@torch.no_grad()
def advantage_stats(adv: Advantages) -> dict[str, float]:
    """The rewards' and advantages' statistics over some rows (combine_stats pools parts of a minibatch); with
    per-token KL rewards, those of each response's first token (whose score the whole response's KL reaches)."""
    values = adv.values if adv.values.dim() == 1 else adv.values[:, 0]
    numbers = {
        "reward_mean": adv.rewards.to(values.dtype).mean(),
        "reward_shaped_mean": adv.shaped.to(values.dtype).mean(),
        "adv_mean": values.mean(),
        "adv_std": values.std() if values.numel() > 1 else values.new_zeros(()),
        "adv_abs_max": values.abs().max(),
        "_adv_sq_mean": (values**2).mean(),
    }
    return dict(zip(numbers, torch.stack(list(numbers.values())).tolist(), strict=True))


@torch.no_grad()
def _sequence_stats(sequence: Tensor, prefix: Tensor, maskf: Tensor, cap: float | None) -> dict[str, float]:
    """The sequence ratios' spread (their variance is what exact unbiasedness costs), and how many
    prefix ratios the cap truncated."""
    tokens = maskf.bool()
    stats = {"seq_ratio_mean": float(sequence.mean()), "seq_ratio_max": float(sequence.max()),
             "seq_ratio_min": float(sequence.min())}
    if cap is not None:
        cut = (prefix >= cap) & tokens
        stats["seq_ratio_truncated_frac"] = float(cut.sum() / tokens.sum().clamp(min=1))
    return stats


@torch.no_grad()
def _tis_stats(tis, maskf: Tensor) -> dict[str, float]:
    """How far the engine weights are from 1, over response tokens, and how many the bounds cut."""
    tokens = maskf.bool()
    weights = tis.weights[tokens] if tokens.any() else tis.weights.new_ones(1)
    cut = tis.outside[tokens] if tokens.any() else tis.outside.new_zeros(1)
    return {"tis_weight_mean": float(weights.mean()), "tis_weight_min": float(weights.min()),
            "tis_truncated_frac": float(cut.to(maskf.dtype).mean())}


def combine_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """The statistics of a batch from those of its parts (micro-batches, processes), as if computed
    on the whole batch at once: shares add up, extremes stay extremes, token means are weighted by
    tokens, row means by rows, and the advantages' standard deviation is the whole batch's."""
    rows = [part.get("_rows", 1.0) for part in parts]
    tokens = [part.get("_tokens", 1.0) for part in parts]

    def weighted(key: str, weights: list[float]) -> float:
        return sum(w * part[key] for w, part in zip(weights, parts, strict=True)) / max(sum(weights), 1e-30)

    combined = {}
    for key in parts[0]:
        if key.startswith("_"):
            continue
        values = [part[key] for part in parts]
        if key in SUMMED_STATS:
            combined[key] = sum(values)
        elif key.endswith("_min"):
            combined[key] = min(values)
        elif key.endswith("_max"):
            combined[key] = max(values)
        elif key in TOKEN_MEAN_STATS:
            combined[key] = weighted(key, tokens)
        elif key == "adv_std" and "_adv_sq_mean" in parts[0]:
            n, mean = sum(rows), weighted("adv_mean", rows)
            variance = (weighted("_adv_sq_mean", rows) - mean**2) * n / max(n - 1, 1)
            combined[key] = max(variance, 0.0) ** 0.5
        else:
            combined[key] = weighted(key, rows)
    return combined
