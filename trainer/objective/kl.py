"""Per-token estimates of the reverse KL divergence KL(pi_theta || pi_ref) from sampled tokens.

The estimators and their formulas are registered in `trainer.objective.estimators` (k1 = l, k2 = l**2 / 2,
k3 = exp(-l) - 1 + l with l = log pi_theta - log pi_ref); this module evaluates them in a safe dtype.
`full` needs whole distributions, not sampled tokens: `trainer.objective.full_kl`.

Only k3 can overflow (through exp(-l), which is also its gradient's size). Its exponent is clamped
at a bound close to the largest finite exponent of the narrowest dtype involved (the computation's,
or an input's, since the gradient flows back in the input dtype: e^10 for float16, e^87 for float32
and bfloat16), so values and gradients are unchanged wherever exp(-l) is finite. A token beyond
the bound keeps a finite value and loses only the gradient of its exp(-l) part (its gradient
coefficient becomes 1, as for k1). `clamped` reports which tokens those are.

The RL libraries clamp further, and so can klstudy, to reproduce them (`objective.kl_log_ratio_clamp`,
`objective.kl_value_clamp`; off by default): the log-ratio l to [-c, c] before the estimator, and the
estimate to [-v, v] after it. A clamp that binds zeroes the gradient through it, which changes what
a configuration differentiates (docs/peers.md); `clamped` counts those tokens too.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.objective.estimators import FULL, REGISTRY, Estimator, logged_estimators, sampled_estimators

__all__ = ["clamped", "compute_dtype", "estimate", "log_ratio", "logged_estimators", "max_exponent",
           "sampled_estimators"]

# exp(x) - 1 + x stays finite for x up to log(finfo.max) minus this margin.
_EXP_MARGIN = 1.0


def _sampled(estimator: str) -> Estimator:
    spec = REGISTRY[estimator]
    if spec.inputs == FULL:
        raise ValueError(f"KL estimator {estimator!r} is computed from whole distributions "
                         "(trainer.objective.full_kl), "
                         "not from sampled tokens' log-probs")
    return spec


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 stays float64; every lower precision is computed in float32."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def max_exponent(*dtypes: torch.dtype) -> float:
    """Largest -l for which exp(-l) (k3's value and gradient) is finite in every one of `dtypes`."""
    return math.log(min(torch.finfo(d).max for d in dtypes)) - _EXP_MARGIN


def log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """l = log pi_theta - log pi_ref, in at least float32."""
    dtype = compute_dtype(logp, ref_logp)
    return logp.to(dtype) - ref_logp.to(dtype)


def clamped(estimator: str, logp: Tensor, ref_logp: Tensor, log_ratio_clamp: float | None = None,
            value_clamp: float | None = None) -> Tensor:
    """Boolean mask of the tokens whose estimate `estimate` clamps: against overflow (only k3 ever), or
    by the given clamps of the log-ratio and the value."""
    spec = _sampled(estimator)
    lr = log_ratio(logp.detach(), ref_logp.detach())
    cut = torch.zeros_like(lr, dtype=torch.bool)
    if spec.clamps:
        cut = -lr > max_exponent(lr.dtype, logp.dtype, ref_logp.dtype)
    if log_ratio_clamp is not None:
        cut = cut | (lr.abs() > log_ratio_clamp)
    if value_clamp is not None:
        cut = cut | (estimate(estimator, logp.detach(), ref_logp.detach(), log_ratio_clamp).abs() > value_clamp)
    return cut


def estimate(estimator: str, logp: Tensor, ref_logp: Tensor, log_ratio_clamp: float | None = None,
             value_clamp: float | None = None) -> Tensor:
    """Elementwise KL estimate of the sampled-token estimator `estimator` (k1, k2, k3, k3+).

    `logp` and `ref_logp` are the log-probabilities of the sampled tokens under the policy and
    the reference; gradients flow through both. The result has their broadcast shape and is
    computed in float32 (float64 when an input is float64). With `log_ratio_clamp` c, l is clamped to
    [-c, c] first; with `value_clamp` v, the estimate to [-v, v] (verl, NeMo-RL, OpenRLHF, SkyRL).
    """
    spec = _sampled(estimator)
    raw = log_ratio(logp, ref_logp)
    bound = max_exponent(raw.dtype, logp.dtype, ref_logp.dtype)
    lr = raw if log_ratio_clamp is None else raw.clamp(-log_ratio_clamp, log_ratio_clamp)
    value = spec.formula(lr, bound)
    if value_clamp is not None:
        value = value.clamp(-value_clamp, value_clamp)
    if spec.gradient_of is None:
        return value
    surrogate = spec.gradient_of(raw, bound)  # straight through: the value, and the surrogate's gradient
    return (value - surrogate).detach() + surrogate
