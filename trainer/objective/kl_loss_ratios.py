"""The off-policy weight on the KL-loss term (objective.kl_loss_ratio): one registered function each,
whose docstring is its theory note. With rho = pi_theta / mu the token ratio, each token's KL-loss term
is beta x weight x k.

Every function takes `(logp, ratio, sequence, engine_logp)`: the policy's log-probs [B, T] (with grad),
the token ratios rho [B, T] (with grad), the detached (sequence [B], prefix [B, T]) ratios where the
configuration needs them (`trainer.objective.pg_terms.sequence_ratios`), and the rollout engine's own
log-probs where it reads them; it returns the weight [B, T], or None for no weight. Tensor methods only:
configs validate without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from trainer.objective.registry import Registry, theory_note

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class KlLossRatio:
    name: str
    weight: Callable[..., Tensor | None]  # (logp, ratio, sequence, engine_logp) -> [B, T] or None
    sequence: bool = False           # reads the prefix ratios (and so objective.sequence_ratio_cap)
    needs_engine_logp: bool = False  # reads the rollout engine's own log-probs
    truncatable: bool = False        # a detached token weight, which objective.kl_loss_ratio_cap may truncate

    @property
    def theory(self) -> str:
        return theory_note(self.weight)


REGISTRY: Registry[KlLossRatio] = Registry("KL-loss ratio")


register = REGISTRY.decorator(KlLossRatio)  # @register(name, **options) over the function


@register("none")
def none(logp: Tensor, ratio: Tensor, sequence: Any, engine_logp: Tensor | None) -> None:
    """beta * k: ignores the behaviour policy."""
    return None


@register("detached", truncatable=True)
def detached(logp: Tensor, ratio: Tensor, sequence: Any, engine_logp: Tensor | None) -> Tensor:
    """beta * sg(rho) * k: the on-policy meaning under samples of mu, token level; on-policy a no-op. With k2, whose
    gradient is l grad log pi, the unbiased token-level gradient of OpenRLHF's unbiased_gradient (rho truncated at
    kl_loss_ratio_cap 10 there)."""
    return ratio.detach()


@register("differentiable")
def differentiable(logp: Tensor, ratio: Tensor, sequence: Any, engine_logp: Tensor | None) -> Tensor:
    """beta * rho * k (DeepSeek-V3.2, TRL's use_bias_correction_kl): NOT a no-op on-policy, where it
    turns k3 into k2."""
    return ratio


@register("sequence", sequence=True)
def prefix(logp: Tensor, ratio: Tensor, sequence: Any, engine_logp: Tensor | None) -> Tensor | None:
    """beta * sg(w_t) * k_t with w_t = prod_{u<=t} rho_u, the prefix ratio: exactly the on-policy meaning
    for any length (token ratios are not)."""
    return sequence[1] if sequence else None


@register("engine", needs_engine_logp=True)
def engine(logp: Tensor, ratio: Tensor, sequence: Any, engine_logp: Tensor | None) -> Tensor:
    """beta * (pi / mu_engine) * k, differentiable, against the rollout engine's own log-probs (NeMo-RL's
    use_on_policy_kl_approximation)."""
    return (logp - engine_logp.to(logp.dtype)).exp()


@register("score")
def score(logp: Tensor, ratio: Tensor, sequence: Any, engine_logp: Tensor | None) -> Tensor:
    """beta * exp(l - sg l) * k (NeMo-RL's default): value 1, keeps the score term; the differentiable
    weight on-policy, no weight at all in value off-policy."""
    return (logp - logp.detach()).exp()
