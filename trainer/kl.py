"""Per-token estimators of the reverse KL divergence KL(pi_theta || pi_ref).

With the token log-ratio l = log pi_theta - log pi_ref and r = exp(-l) (see KL_THEORY.md):

    k1 = l              unbiased, high variance, can be negative
    k2 = l**2 / 2       biased, second-order match to the KL
    k3 = r - 1 + l      unbiased, never negative, low variance

Only k3 can overflow (through exp(-l), which is also its gradient's size). Its exponent is clamped
at a bound close to the largest finite exponent of the narrowest dtype involved (the computation's,
or an input's, since the gradient flows back in the input dtype: e^10 for float16, e^87 for float32
and bfloat16), so values and gradients are unchanged wherever exp(-l) is finite. A token beyond
the bound keeps a finite value and loses only the gradient of its exp(-l) part (its gradient
coefficient becomes 1, as for k1). `clamped` reports which tokens those are.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.choices import ESTIMATORS

# exp(x) - 1 + x stays finite for x up to log(finfo.max) minus this margin.
_EXP_MARGIN = 1.0


def _check_name(estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}"
        )


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 stays float64; every lower precision is computed in float32."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def max_exponent(*dtypes: torch.dtype) -> float:
    """Largest -l for which exp(-l) (k3's value and gradient) is finite in every one of `dtypes`."""
    return math.log(min(torch.finfo(d).max for d in dtypes)) - _EXP_MARGIN


def log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """l = log pi_theta - log pi_ref, in at least float32."""
    dtype = _compute_dtype(logp, ref_logp)
    return logp.to(dtype) - ref_logp.to(dtype)


def clamped(estimator: str, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Boolean mask of the tokens whose estimate `estimate` clamps (only k3 ever clamps)."""
    _check_name(estimator)
    lr = log_ratio(logp.detach(), ref_logp.detach())
    if estimator != "k3":
        return torch.zeros_like(lr, dtype=torch.bool)
    return -lr > max_exponent(lr.dtype, logp.dtype, ref_logp.dtype)


def estimate(estimator: str, logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Elementwise KL estimate of `estimator` ("k1", "k2" or "k3").

    `logp` and `ref_logp` are the log-probabilities of the sampled tokens under the policy and
    the reference; gradients flow through both. The result has their broadcast shape and is
    computed in float32 (float64 when an input is float64).
    """
    _check_name(estimator)
    lr = log_ratio(logp, ref_logp)
    if estimator == "k1":
        return lr
    if estimator == "k2":
        return 0.5 * lr.square()
    # k3 = (exp(-l) - 1) + l; expm1 keeps precision for small |l|.
    neg = torch.clamp(-lr, max=max_exponent(lr.dtype, logp.dtype, ref_logp.dtype))
    return torch.expm1(neg) + lr
