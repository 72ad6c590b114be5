"""How the policy-gradient term corrects for samples of mu (objective.pg_ratio): one registered function
each, whose docstring is its theory note.

Every function takes `(logp, old, adv_t, maskf, config, sequence)`: the policy's log-probs [B, T] (with
grad), the sampler's [B, T], the advantages [B, 1] or [B, T], the float response mask, the
ObjectiveConfig (its clips and bounds), and the detached sequence ratios w = pi(y) / mu(y) [B] where
the ratio reads them (`sequence`); it returns each token's term and which tokens the clips and bounds cut
(`PolicyGradient`). Tensor methods only: configs validate without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from trainer.objective.registry import Registry, theory_note

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class PolicyGradient:
    per_token: Tensor           # [B, T] the term of each token, to aggregate
    clipped: Tensor             # [B, T] bool: tokens PPO's clip takes the gradient from
    dual_clipped: Tensor | None  # [B, T] bool: tokens the dual clip bounds; None when it is off
    bounded: Tensor | None      # [B, T] bool: tokens whose ratio the bounds cut; None without them


@dataclass(frozen=True)
class PgRatio:
    name: str
    term: Callable[..., PolicyGradient]  # (logp, old, adv_t, maskf, config, sequence) -> PolicyGradient
    sequence: bool = False  # weighs whole responses: reads the sequence ratios; the token bounds do not apply
    trust_region: bool = False  # clip_eps (and clip_eps_high) is the width of its own region; no other bound

    @property
    def theory(self) -> str:
        return theory_note(self.term)


REGISTRY: Registry[PgRatio] = Registry("policy-gradient ratio")


register = REGISTRY.decorator(PgRatio)  # @register(name, **options) over the function


def _bound(ratio: Tensor, config: Any) -> tuple[Tensor, Tensor | None]:
    """The token ratios after ratio_cap / ratio_floor, and which tokens the bounds cut (None without them)."""
    if config.ratio_cap is None:
        return ratio, None
    floor = config.ratio_floor or 0.0
    outside = (ratio.detach() < floor) | (ratio.detach() > config.ratio_cap)
    if config.ratio_mode == "mask":
        return ratio.masked_fill(outside, 0.0), outside
    return ratio.clamp(floor, config.ratio_cap), outside


@register("token")
def token_ratio(logp: Tensor, old: Tensor, adv_t: Tensor, maskf: Tensor, config: Any, sequence: Tensor | None
                ) -> PolicyGradient:
    """PPO's per-token ratio rho_t = pi_theta / mu, differentiable: -rho_t A per token, the ratio bounded
    (ratio_cap, ratio_floor, ratio_mode), PPO-clipped with clip_eps, then bounded by the dual clip
    (clip_ratio_c). What the RL libraries do; biased for responses of more than one token."""
    log_ratio = logp - old
    bounds: list[Tensor | None] = [None]

    def ppo(ratio: Tensor) -> tuple[Tensor, Tensor]:
        ratio, bounds[0] = _bound(ratio, config)
        pg = -ratio * adv_t
        if config.clip_eps is None:
            return pg, pg.new_zeros(pg.shape).bool()
        high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
        pg_clipped = -ratio.clamp(1 - config.clip_eps, 1 + high) * adv_t
        return pg.maximum(pg_clipped), pg_clipped > pg

    if config.clip_ratio_c is None:
        pg, clipped = ppo(log_ratio.exp())
        return PolicyGradient(pg, clipped, None, bounds[0])
    bound = -config.clip_ratio_c * adv_t  # > 0 where the advantage is negative
    dual = (adv_t < 0) & (ppo(log_ratio.detach().exp())[0].detach() > bound)
    # a bounded token's ratio (e^100 when stale) never enters the graph: no inf x 0 = nan gradient
    pg, clipped = ppo(log_ratio.masked_fill(dual, 0.0).exp())
    return PolicyGradient(pg.where(~dual, bound), clipped & ~dual, dual, bounds[0])


@register("sequence", sequence=True)
def sequence_ratio(logp: Tensor, old: Tensor, adv_t: Tensor, maskf: Tensor, config: Any, sequence: Tensor | None
                ) -> PolicyGradient:
    """The detached sequence ratio w = pi(y) / mu(y) on every token's score, sg(w) A grad log pi_t: exactly
    unbiased (REINFORCE with importance sampling) when the advantage's baseline is a mean of rewards (not
    grpo's std scaling). The value -w A is spread over the response's tokens. With clip_eps, w is
    PPO-clipped as a whole, -min(w A, clip(w) A) (TRL's RLOOTrainer): biased wherever the clip binds, and a
    response the clip binds on has no gradient. No clip_ratio_c or ratio_cap (they bound token ratios);
    sequence_ratio_cap truncates w."""
    w_t = sequence.unsqueeze(-1)
    surrogate = w_t * adv_t
    clipped = surrogate.new_zeros(surrogate.shape).bool()
    if config.clip_eps is not None:
        high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
        bounded = w_t.clamp(1 - config.clip_eps, 1 + high) * adv_t
        clipped = bounded < surrogate  # the min takes the clipped side: no gradient there
        surrogate = surrogate.minimum(bounded)
    clipped = clipped.expand_as(logp) & maskf.bool()
    lengths = maskf.sum(-1, keepdim=True).clamp(min=1)
    score = (logp - logp.detach()).exp() - 1.0  # 0 in value, grad log pi_t in the gradient
    per_token = -surrogate.detach() / lengths - (w_t * adv_t).where(~clipped, 0.0) * score
    return PolicyGradient(per_token, clipped, None, None)


def _trust_region(logp: Tensor, old: Tensor, adv_t: Tensor, config: Any, leaves: Tensor) -> PolicyGradient:
    """-A sg(w) grad log pi per token, w = rho_t = pi_theta / mu bounded by ratio_cap and ratio_floor (verl's
    clip_ratio_c truncates it; unbounded, the term is -rho_t A, value and gradient), and nothing where the token
    `leaves` the trust region."""
    weight, bounded = _bound((logp - old).exp().detach(), config)
    score = (logp - logp.detach()).exp()  # 1 in value, grad log pi in the gradient
    return PolicyGradient((-adv_t * weight * score).masked_fill(leaves, 0.0), leaves, None, bounded)


def _widths(config: Any) -> tuple[float, float]:
    """The trust region's width below and above: clip_eps, and clip_eps_high where given."""
    return config.clip_eps, config.clip_eps if config.clip_eps_high is None else config.clip_eps_high


@register("dppo-tv", trust_region=True)
def dppo_tv(logp: Tensor, old: Tensor, adv_t: Tensor, maskf: Tensor, config: Any, sequence: Tensor | None
            ) -> PolicyGradient:
    """DPPO's trust region on the sampled token's probability, its total variation (prime-rl's default loss;
    verl's dppo_tv): -rho_t A per token, rho_t = pi_theta / mu, its gradient -rho_t A grad log pi, and a token
    dropped (no value, no gradient) where the policy has moved its probability out of the region in the
    advantage's direction: p - p_mu > clip_eps_high where A > 0, p - p_mu < -clip_eps where A <= 0 (p = e^logp).
    ratio_cap truncates the weight rho_t, detached (verl's clip_ratio_c): the gradient beyond the cap is
    -ratio_cap A grad log pi, not 0 as for the token ratio's clamp. Exactly on-policy nothing is dropped
    (-A grad log pi); off-policy biased, as PPO's token ratio."""
    low, high = _widths(config)
    moved = logp.detach().exp() - old.exp()
    rising = adv_t > 0
    return _trust_region(logp, old, adv_t, config, (rising & (moved > high)) | (~rising & (moved < -low)))


@register("dppo-kl", trust_region=True)
def dppo_kl(logp: Tensor, old: Tensor, adv_t: Tensor, maskf: Tensor, config: Any, sequence: Tensor | None
            ) -> PolicyGradient:
    """DPPO's trust region in the binary KL of the sampled token (verl's dppo_kl): dppo-tv's term, a token dropped
    where KL(Bern(p_mu) || Bern(p)) = p_mu log(p_mu / p) + (1 - p_mu) log((1 - p_mu) / (1 - p)) exceeds
    clip_eps_high while p > p_mu and A > 0, or clip_eps while p < p_mu and A <= 0: the region is a divergence of
    the token's probability, wider where p_mu is near 1/2 than at its ends. Computed with xlogy (verl adds 1e-8
    inside its logarithms): 0 log 0 = 0 where p_mu is 1. Exactly on-policy nothing is dropped; off-policy biased, as
    dppo-tv."""
    low, high = _widths(config)
    p, p_mu = logp.detach().exp(), old.exp()
    p_not, p_mu_not = -logp.detach().expm1(), -old.expm1()  # 1 - p, 1 - p_mu, exact near 1
    binary = p_mu * (old - logp.detach()) + p_mu_not.xlogy(p_mu_not) - p_mu_not.xlogy(p_not)
    rising = adv_t > 0
    leaves = (rising & (binary > high) & (p > p_mu)) | (~rising & (binary > low) & (p < p_mu))
    return _trust_region(logp, old, adv_t, config, leaves)
