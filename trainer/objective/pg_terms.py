"""The policy-gradient term per token (objective.pg_ratio, a registry: trainer.objective.pg_ratios, where each
ratio's docstring says what it computes) and the detached sequence and prefix ratios that the sequence-level
weights read. Token ratios may be bounded before PPO's clip (`ratio_cap`, `ratio_floor`, `ratio_mode`):

    truncate   rho_t clamped to [ratio_floor, ratio_cap]: beyond a bound the token keeps the bound's value
               and has no gradient (the prime-rl fork of "A Comedy of Estimators": torch.clamp(ratio, 0, 8),
               bbartoldson/tba-prime@59c2f8ae src/zeroband/training/loss.py, tba_loss and grpo_loss_ratio)
    mask       a token whose rho_t leaves [ratio_floor, ratio_cap] contributes nothing (IcePop as the same fork
               runs it: icepop_loss, mask_ratio_low 0.125, mask_ratio_high 8)

The sequence ratio PPO-clipped as a whole is TRL's RLOOTrainer (huggingface/trl@f2cd5771
trl/trainer/rloo_trainer.py:1686-1695). Free of the run's loop: `trainer.objective.loss` calls it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.objective import estimators, pg_ratios
from trainer.objective.objective_config import ObjectiveConfig
from trainer.objective.pg_ratios import PolicyGradient


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
    return pg_ratios.REGISTRY[config.pg_ratio].term(logp, old, adv_t, maskf, config, sequence)
