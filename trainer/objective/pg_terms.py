"""The policy-gradient term per token: its importance ratio (objective.pg_ratio), the bounds on it, and PPO's clips.

Token ratios (`pg_ratio: token`): each token's term is -rho_t A with rho_t = pi_theta / mu, differentiable.
Before PPO's clip (clip_eps, clip_eps_high) and the dual clip (clip_ratio_c), the ratio itself may be bounded
(`ratio_cap`, `ratio_floor`, `ratio_mode`):

    truncate   rho_t clamped to [ratio_floor, ratio_cap]: beyond a bound the token keeps the bound's value
               and has no gradient (the prime-rl fork of "A Comedy of Estimators": torch.clamp(ratio, 0, 8),
               bbartoldson/tba-prime@59c2f8ae src/zeroband/training/loss.py, tba_loss and grpo_loss_ratio)
    mask       a token whose rho_t leaves [ratio_floor, ratio_cap] contributes nothing (IcePop as the same fork
               runs it: icepop_loss, mask_ratio_low 0.125, mask_ratio_high 8)

Sequence ratios (`pg_ratio: sequence`): each response's term is -w A with w = pi(y) / mu(y); its gradient
w A sum_t grad log pi_t is put on the tokens (the value -w A is spread over them, so that the response's
tokens sum to it). With clip_eps, the ratio is PPO-clipped as a whole, -min(w A, clip(w, 1 - eps, 1 + eps_high) A):
TRL's RLOOTrainer (huggingface/trl@f2cd5771 trl/trainer/rloo_trainer.py:1686-1695); where the clip binds the
response has no gradient. Free of the run's loop: `trainer.objective.loss` calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.objective import estimators
from trainer.objective.objective_config import ObjectiveConfig


@dataclass(frozen=True)
class PolicyGradient:
    per_token: Tensor           # [B, T] the term of each token, to aggregate
    clipped: Tensor             # [B, T] bool: tokens PPO's clip takes the gradient from
    dual_clipped: Tensor | None  # [B, T] bool: tokens the dual clip bounds; None when it is off
    bounded: Tensor | None      # [B, T] bool: tokens whose ratio the bounds cut; None without them


def uses_sequence_ratios(config: ObjectiveConfig) -> bool:
    return config.pg_ratio == "sequence" or (config.kl_in_loss and config.kl_loss_ratio == "sequence")


def sequence_ratios(logp: Tensor, old: Tensor, maskf: Tensor, config: ObjectiveConfig) -> tuple[Tensor, Tensor]:
    """Detached importance weights of whole responses, w = pi(y) / mu(y) [B], and of the prefixes each
    KL-loss token's term depends on [B, T] (1 on-policy, where old is logp itself), each truncated at
    sequence_ratio_cap when set: w_t = prod_{u<=t} pi_u / mu_u for a term of the sampled token, and
    prod_{u<t} for one of the prefix alone (`full`'s KL_t: a weight through y_t would be exact too, and
    noisier). Not clamped otherwise: a weight that overflows makes the update non-finite, and the loop
    skips it and counts it."""
    token_log = (logp.detach() - old) * maskf
    through = torch.cumsum(token_log, dim=-1)
    prefix_log = through if estimators.REGISTRY[config.estimator].token_dependent else through - token_log
    sequence_log = through[:, -1]
    if config.sequence_ratio_cap is not None:
        cap = math.log(config.sequence_ratio_cap)
        prefix_log, sequence_log = prefix_log.clamp(max=cap), sequence_log.clamp(max=cap)
    return sequence_log.exp(), prefix_log.exp()


def policy_gradient(logp: Tensor, old: Tensor, adv_t: Tensor, maskf: Tensor, config: ObjectiveConfig,
                    sequence: Tensor | None) -> PolicyGradient:
    """The policy-gradient term of each token, with `sequence` the detached sequence ratios [B] when
    pg_ratio is sequence; adv_t is [B, 1] or [B, T]."""
    if config.pg_ratio == "sequence":
        return _sequence_term(logp, sequence, adv_t, maskf, config)
    return _token_term(logp - old, adv_t, config)


def _sequence_term(logp: Tensor, w: Tensor, adv_t: Tensor, maskf: Tensor, config: ObjectiveConfig) -> PolicyGradient:
    """-min(w A, clip(w) A) per response (without clip_eps, -w A), spread over its tokens in value; each token
    of a response the clip leaves alone carries w A grad log pi_t: E_mu[w A sum_t grad log pi_t] = grad E_pi[R]
    (exact when the advantage's baseline is a mean of rewards and no clip binds)."""
    w_t = w.unsqueeze(-1)
    surrogate = w_t * adv_t
    clipped = torch.zeros_like(surrogate, dtype=torch.bool)
    if config.clip_eps is not None:
        high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
        bounded = torch.clamp(w_t, 1 - config.clip_eps, 1 + high) * adv_t
        clipped = bounded < surrogate  # the min takes the clipped side: no gradient there
        surrogate = torch.minimum(surrogate, bounded)
    clipped = clipped.expand_as(logp) & maskf.bool()
    lengths = maskf.sum(-1, keepdim=True).clamp(min=1)
    score = torch.exp(logp - logp.detach()) - 1.0  # 0 in value, grad log pi_t in the gradient
    per_token = -surrogate.detach() / lengths - torch.where(clipped, 0.0, w_t * adv_t) * score
    return PolicyGradient(per_token, clipped, None, None)


def _bound(ratio: Tensor, config: ObjectiveConfig) -> tuple[Tensor, Tensor | None]:
    """The token ratios after ratio_cap / ratio_floor, and which tokens the bounds cut (None without them)."""
    if config.ratio_cap is None:
        return ratio, None
    floor = config.ratio_floor or 0.0
    with torch.no_grad():
        outside = (ratio < floor) | (ratio > config.ratio_cap)
    if config.ratio_mode == "mask":
        return torch.where(outside, torch.zeros_like(ratio), ratio), outside
    return torch.clamp(ratio, floor, config.ratio_cap), outside


def _token_term(log_ratio: Tensor, adv_t: Tensor, config: ObjectiveConfig) -> PolicyGradient:
    """Per-token -ratio x A, the ratio bounded, PPO-clipped with clip_eps, then bounded by the dual clip; and
    which tokens each bound or clip cuts (the dual clip's mask is None when it is off)."""
    bounds: list[Tensor | None] = [None]

    def ppo(ratio: Tensor) -> tuple[Tensor, Tensor]:
        ratio, bounds[0] = _bound(ratio, config)
        pg = -ratio * adv_t
        if config.clip_eps is None:
            return pg, torch.zeros_like(pg, dtype=torch.bool)
        high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
        pg_clipped = -torch.clamp(ratio, 1 - config.clip_eps, 1 + high) * adv_t
        return torch.maximum(pg, pg_clipped), pg_clipped > pg

    if config.clip_ratio_c is None:
        pg, clipped = ppo(log_ratio.exp())
        return PolicyGradient(pg, clipped, None, bounds[0])
    bound = -config.clip_ratio_c * adv_t  # > 0 where the advantage is negative
    with torch.no_grad():
        dual = (adv_t < 0) & (ppo(log_ratio.detach().exp())[0] > bound)
    # a bounded token's ratio (e^100 when stale) never enters the graph: no inf x 0 = nan gradient
    pg, clipped = ppo(log_ratio.masked_fill(dual, 0.0).exp())
    return PolicyGradient(torch.where(dual, bound, pg), clipped & ~dual, dual, bounds[0])
