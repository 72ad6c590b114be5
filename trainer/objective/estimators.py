"""The KL estimators: one registration each, with its formula, its inputs and its theory.

With the token log-ratio l = log pi_theta - log pi_ref of a sampled token (docs/concepts/theory.md, "Estimators"):

    k1 = l              unbiased, high variance, can be negative
    k2 = l**2 / 2       biased, second-order match to the KL
    k3 = r - 1 + l      r = exp(-l): unbiased, never negative, low variance
    k3+                 k3's value with k2's gradient (verl's `+` suffix, a straight-through
                        estimate: the value is detached, k2's gradient l * grad log pi is added,
                        from the unclamped log-ratio: clamps bound its value, never its gradient)
    full                the exact next-token KL(pi(.|y_<t) || pi_ref(.|y_<t)), summed over the
                        vocabulary from both models' hidden states (trainer.objective.full_kl): no sampling
                        noise at the token (Rao-Blackwellised; Amini, Vieira and Cotterell 2025)

A sampled-token estimator's formula maps l (and k3's exponent bound, see trainer.objective.kl) to the
per-token estimate using tensor methods only, so this module needs no torch.

`theory` is the on-policy statement for responses longer than one token (docs/concepts/theory.md, "What
each configuration differentiates"), keyed by (placement, kl_loss_ratio): the verdict
`trainer.audits.audit` must reach. docs/full_kl.md derives full's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from trainer.objective.registry import Registry

SAMPLED = "sampled"  # log-probs of the sampled tokens under both models
FULL = "full"        # both models' last hidden states: whole next-token distributions


@dataclass(frozen=True)
class Estimator:
    name: str
    summary: str
    inputs: str = SAMPLED
    formula: Callable[[Any, float], Any] | None = None  # (l, k3's exponent bound) -> estimate, SAMPLED only
    clamps: bool = False                                 # the formula bounds an exponent (trainer.objective.kl)
    token_dependent: bool = True  # the term at t depends on y_t itself (off-policy weights run through it)
    logged: bool = True           # its value is logged as kl_<name> (not when it repeats another's value)
    # (l, bound) -> the term whose gradient the estimate takes instead of its own (a straight-through
    # estimate: the formula's value, detached and clamped as configured, plus this term's gradient)
    gradient_of: Callable[[Any, float], Any] | None = None
    theory: dict[tuple[str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.formula is None) != (self.inputs == FULL):
            raise ValueError(f"estimator {self.name!r}: a formula exactly when its inputs are {SAMPLED!r}")


REGISTRY: Registry[Estimator] = Registry("KL estimator")

REGISTRY.register(Estimator(
    "k1", "l", formula=lambda lr, bound: lr,
    theory={("reward", "none"): "unbiased", ("loss", "none"): "zero", ("reward+loss", "none"): "unbiased",
            ("loss", "differentiable"): "per-prefix reverse", ("reward-to-go", "none"): "unbiased",
            ("reward-to-go+loss", "none"): "unbiased", ("reward-token", "none"): "per-prefix reverse",
            ("reward-centred", "none"): "scaled"}))
REGISTRY.register(Estimator(
    "k2", "l^2 / 2", formula=lambda lr, bound: 0.5 * lr.square(),
    theory={("reward", "none"): "biased", ("loss", "none"): "per-prefix reverse",
            ("reward+loss", "none"): "biased", ("reward-to-go", "none"): "biased",
            ("reward-to-go+loss", "none"): "biased", ("reward-token", "none"): "biased",
            ("reward-centred", "none"): "biased"}))


def _k3(lr, bound):
    """(exp(-l) - 1) + l, the exponent clamped at `bound`; expm1 keeps precision for small |l|."""
    return (-lr).clamp(max=bound).expm1() + lr


REGISTRY.register(Estimator(
    "k3", "exp(-l) - 1 + l", formula=_k3, clamps=True,
    theory={("reward", "none"): "biased", ("loss", "none"): "per-prefix forward",
            ("reward+loss", "none"): "unbiased", ("loss", "differentiable"): "per-prefix reverse",
            ("reward-to-go", "none"): "biased", ("reward-to-go+loss", "none"): "unbiased",
            ("reward-token", "none"): "biased", ("reward-centred", "none"): "biased"}))
REGISTRY.register(Estimator(
    "k3+", "k3's value, k2's gradient", formula=_k3, gradient_of=lambda lr, bound: 0.5 * lr.square(), clamps=True,
    logged=False,
    theory={("reward", "none"): "biased", ("loss", "none"): "per-prefix reverse",
            ("reward+loss", "none"): "biased", ("reward-to-go", "none"): "biased",
            ("reward-to-go+loss", "none"): "biased", ("reward-token", "none"): "biased",
            ("reward-centred", "none"): "biased"}))
REGISTRY.register(Estimator(
    "full", "sum_v pi(v) log(pi(v) / pi_ref(v))", inputs=FULL, token_dependent=False,
    theory={("reward", "none"): "biased", ("loss", "none"): "per-prefix reverse",
            ("reward+loss", "none"): "unbiased", ("loss", "differentiable"): "per-prefix reverse",
            ("reward+loss", "differentiable"): "unbiased", ("reward-to-go", "none"): "biased",
            ("reward-to-go+loss", "none"): "unbiased", ("reward-token", "none"): "zero",
            ("reward-centred", "none"): "biased"}))



def sampled_estimators() -> tuple[str, ...]:
    """The estimators computed from the sampled tokens' log-probs, read from the registry when asked (so that a
    plugin's count, whenever it registers)."""
    return tuple(e.name for e in REGISTRY if e.inputs == SAMPLED)


def logged_estimators() -> tuple[str, ...]:
    """The sampled estimators whose values are logged as kl_<name> statistics."""
    return tuple(e.name for e in REGISTRY if e.inputs == SAMPLED and e.logged)
