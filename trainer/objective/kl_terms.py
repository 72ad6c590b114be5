"""The KL term of the objective, per token: its estimate (clamped as configured), what the rewards are
shaped with (summed over a response, to go, or each token's own: trainer.objective.placements), and the KL-loss
term with its off-policy weight (objective.kl_loss_ratio). `trainer.objective.loss` puts them together.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.objective import estimators, kl, kl_loss_ratios, placements
from trainer.objective.objective_config import ObjectiveConfig


def token_estimate(config: ObjectiveConfig, logp: Tensor, ref_logp: Tensor, token_kl: Tensor | None,
                   value_clamp: bool = True, estimator: str | None = None) -> Tensor:
    """The per-token KL term [B, T] of `estimator` (config.estimator unless given): from the sampled tokens'
    log-probs (clamped as configured; the value's clamp left to the caller without `value_clamp`), or the exact
    full-vocabulary KL (`token_kl`, computed by trainer.objective.full_kl) for an estimator that needs it."""
    if estimator is not None and estimator != config.estimator:
        return kl.estimate(estimator, logp, ref_logp, config.kl_log_ratio_clamp,
                           config.kl_value_clamp if value_clamp else None)
    if config.needs_full_kl:
        if token_kl is None:
            raise ValueError(f"estimator {config.estimator}: compute_loss needs token_kl, the exact per-token KL "
                             "over the vocabulary (trainer.objective.full_kl)")
        return token_kl.to(kl.compute_dtype(logp, ref_logp))
    return kl.estimate(config.estimator, logp, ref_logp, config.kl_log_ratio_clamp,
                       config.kl_value_clamp if value_clamp else None)


@torch.no_grad()
def reward_kl(config: ObjectiveConfig, logp: Tensor, ref_logp: Tensor, mask: Tensor,
              token_kl: Tensor | None = None) -> Tensor:
    """The KL estimate that the rewards are shaped with, from the log-probs (and, for `full`, token_kl) of
    the policy config.reward_kl names: [B], each response's sum over its tokens of config.estimator; or,
    for a placement with per-token KL rewards (reward-to-go, reward-token), [B, T], 0 on padding.
    Detached: it reaches the gradient only through the advantages."""
    estimate = token_estimate(config, logp, ref_logp, token_kl) * mask.to(kl.compute_dtype(logp, ref_logp))
    return estimate if config.kl_in_token_rewards else estimate.sum(dim=-1)


def kl_reward_span(token_kl: Tensor, config: ObjectiveConfig) -> Tensor:
    """[B, T] the KL each token's score is weighted by: the KL at and after it (to go; after it for an
    estimator whose term at t does not depend on y_t, as `full`'s, whose own term would only add noise),
    or its own."""
    if placements.REGISTRY[config.placement].reward_span == "token":
        return token_kl
    to_go = token_kl.flip(-1).cumsum(-1).flip(-1)
    return to_go if estimators.REGISTRY[config.estimator].token_dependent else to_go - token_kl


def centred_kl(sequence_kl: Tensor, centre_kl: Tensor, group_size: int) -> Tensor:
    """[B] each response's KL minus the mean over its group of `centre_kl` (the sampler's KL of the same
    responses; `sequence_kl` itself when the reward's KL is the sampler's): placement reward-centred."""
    centre = centre_kl.view(-1, group_size).mean(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)
    return sequence_kl - centre


def kl_loss_term(config: ObjectiveConfig, logp: Tensor, ref_logp: Tensor, token_kl: Tensor | None,
                 weight: Tensor | None, estimator: str | None = None) -> Tensor:
    """Each token's KL-loss term: its estimate (of `estimator`, config.estimator unless given), times its weight,
    clamped as the libraries clamp it. With a weight (NeMo-RL, slime), the value clamp bounds the weighted term, and
    where the log-ratio clamp binds the weight has no gradient either: a clamped token contributes no gradient at all,
    as without a weight."""
    spec = estimators.REGISTRY[estimator or config.estimator]
    after = weight is not None and config.kl_value_clamp is not None and spec.gradient_of is None
    estimate = token_estimate(config, logp, ref_logp, token_kl, value_clamp=not after, estimator=estimator)
    if weight is None:
        return estimate
    if config.kl_log_ratio_clamp is not None:
        weight = torch.where(kl.log_ratio(logp, ref_logp).abs() > config.kl_log_ratio_clamp, weight.detach(), weight)
    term = weight * estimate
    return term.clamp(-config.kl_value_clamp, config.kl_value_clamp) if after else term


def kl_loss_weight(config: ObjectiveConfig, logp: Tensor, ratio: Tensor, sequence: tuple[Tensor, Tensor] | None,
                   engine_logp: Tensor | None) -> Tensor | None:
    """The weight on each KL-loss token (objective.kl_loss_ratio, trainer.objective.kl_loss_ratios), None for none;
    truncated at kl_loss_ratio_cap where set."""
    weight = kl_loss_ratios.REGISTRY[config.kl_loss_ratio].weight(logp, ratio, sequence, engine_logp)
    return weight if config.kl_loss_ratio_cap is None else weight.clamp(max=config.kl_loss_ratio_cap)
