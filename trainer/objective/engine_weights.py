"""Importance weights of the policy-gradient term against the rollout engine (objective.tis_cap).

The engine samples from mu_engine, which is not exactly the trainer's pi_old (another kernel, another
precision, a quantised copy). Each library weights the policy-gradient term by some detached
function of rho = pi_old / mu_engine, bounded to [floor, cap] (objective.tis_floor, tis_cap):

    level token,     mode truncate   clamp(rho_t, floor, cap)                  TIS (verl, OpenRLHF, slime, ...)
    level token,     mode mask       rho_t inside [floor, cap], else 0         IcePop
    level sequence,  mode truncate   clamp(prod_t rho_t, floor, cap)           sequence TIS (verl, SkyRL, TRL)
    level sequence,  mode mask       prod_t rho_t inside [floor, cap], else 0  sequence masking (TRL's default)
    level geometric, mode mask       rho_t where the response's geometric mean (prod rho)^(1/T)
                                     lies in [floor, cap], else 0              seq-mask-tis (OpenRLHF, NeMo-RL)

Only the untruncated sequence weight corrects the sampling distribution exactly; the audit
measures what each leaves (docs/peers.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.objective.objective_config import ObjectiveConfig


@dataclass(frozen=True)
class EngineWeights:
    weights: Tensor  # [B, T] detached, >= 0
    outside: Tensor  # [B, T] bool: tokens whose ratio the bounds cut (truncated or masked)


@torch.no_grad()
def engine_weights(old: Tensor, engine_logp: Tensor, maskf: Tensor, config: ObjectiveConfig) -> EngineWeights:
    """The weights of each token's policy-gradient term, from the trainer's log-probs of the policy that
    sampled (`old`) and the engine's (`engine_logp`), both [B, T]."""
    floor, cap = config.tis_floor or 0.0, config.tis_cap
    log_floor = math.log(floor) if floor > 0 else -math.inf
    log_ratio = (old.detach() - engine_logp.to(old.dtype)) * maskf
    if config.tis_level == "geometric":
        mean_log = log_ratio.sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1)
        inside = ((mean_log >= log_floor) & (mean_log <= math.log(cap))).expand_as(log_ratio)
        weights = torch.where(inside, log_ratio.exp(), torch.zeros_like(log_ratio))
        return EngineWeights(weights, ~inside)
    if config.tis_level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(maskf)
    inside = (log_ratio >= log_floor) & (log_ratio <= math.log(cap))
    if config.tis_mode == "truncate":  # the log clamped before exp: a huge sequence ratio stays finite
        return EngineWeights(log_ratio.clamp(min=log_floor, max=math.log(cap)).exp(), ~inside)
    return EngineWeights(torch.where(inside, log_ratio.exp(), torch.zeros_like(log_ratio)), ~inside)
