"""The analytic optimum of the KL-regularized objective, per prompt, from the reference's rewards.

For one prompt x, J(pi) = E_pi[R] - beta KL(pi || pi_ref). Its maximiser is
pi* = pi_ref exp(R / beta) / Z with Z = E_{pi_ref}[exp(R / beta)], its value is
J* = beta log Z, and for every policy J* - J(pi) = beta KL(pi || pi*) >= 0 (docs/concepts/theory.md, "The
optimum"; docs/concepts/optimum.md). So the objective gap J* - J(pi) measures how far a
trained policy is from the optimum, in reward units.

Everything here depends on pi_ref only through the distribution of the reward under pi_ref, given
per prompt as a histogram (reward values and their counts among the reference's samples). For a
0/1 reward with pass rate p, J* = beta log(1 + p (e^{1/beta} - 1)). Computed with log-sum-exp, so
that a small beta (e^{1/beta} overflows float64 below beta = 0.0014) stays finite.
Pure numpy: the study level (sweep) uses it to compare runs at any beta.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Histogram = Sequence[tuple[float, int]]  # (reward value, how many reference samples got it)


def _weights(histogram: Histogram) -> tuple[np.ndarray, np.ndarray]:
    values = np.array([float(v) for v, _ in histogram], dtype=np.float64)
    counts = np.array([float(c) for _, c in histogram], dtype=np.float64)
    if values.size == 0 or counts.min() < 0 or counts.sum() <= 0:
        raise ValueError(f"a reward histogram needs at least one sample, got {list(histogram)!r}")
    return values, counts / counts.sum()


def _log_tilt(values: np.ndarray, probs: np.ndarray, beta: float) -> tuple[np.ndarray, float]:
    """log of pi*'s weight on each reward value, and log Z."""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    with np.errstate(divide="ignore"):
        logits = np.log(probs) + values / beta
    log_z = float(np.logaddexp.reduce(logits))
    return logits - log_z, log_z


def optimal_value(histogram: Histogram, beta: float) -> float:
    """J* = beta log E_ref[exp(R / beta)]: the best value of E[R] - beta KL(pi || pi_ref)."""
    values, probs = _weights(histogram)
    return beta * _log_tilt(values, probs, beta)[1]


def optimal_reward(histogram: Histogram, beta: float) -> float:
    """E_{pi*}[R]: the optimum's mean reward."""
    values, probs = _weights(histogram)
    log_weights, _ = _log_tilt(values, probs, beta)
    return float(np.exp(log_weights) @ values)


def optimal_kl(histogram: Histogram, beta: float) -> float:
    """KL(pi* || pi_ref) = E_{pi*}[R] / beta - log Z, since log(pi* / pi_ref) = R / beta - log Z."""
    values, probs = _weights(histogram)
    log_weights, log_z = _log_tilt(values, probs, beta)
    return max(0.0, float(np.exp(log_weights) @ values) / beta - log_z)


def reference_value(histogram: Histogram) -> float:
    """E_ref[R]: the reference's own objective (its KL to itself is 0)."""
    values, probs = _weights(histogram)
    return float(probs @ values)


def frontier(histograms: Sequence[Histogram], betas: Sequence[float]) -> list[tuple[float, float, float]]:
    """(beta, KL(pi* || pi_ref), E_{pi*}[R]) averaged over prompts, for each beta: the most reward any
    policy gets for its KL to the reference (the optima of all betas trace it)."""
    return [(float(b), float(np.mean([optimal_kl(h, b) for h in histograms])),
             float(np.mean([optimal_reward(h, b) for h in histograms]))) for b in betas]


def objective_gap(histograms: Sequence[Histogram], rewards: Sequence[float], kls: Sequence[float],
                  beta: float) -> dict[str, float]:
    """The objective of a policy whose per-prompt mean reward and KL(pi || pi_ref) are `rewards` and
    `kls`, its optimum and its gap J* - J, averaged over prompts, each with its standard error over
    prompts (which also carries the sampling noise within each prompt's estimates)."""
    if not len(histograms) == len(rewards) == len(kls) > 0:
        raise ValueError(f"one histogram, reward and KL per prompt, got {len(histograms)}, {len(rewards)}, "
                         f"{len(kls)}")
    reward, kl = np.asarray(rewards, dtype=np.float64), np.asarray(kls, dtype=np.float64)
    optimum = np.array([optimal_value(h, beta) for h in histograms])
    objective = reward - beta * kl
    out = {"beta": float(beta)}
    for name, per_prompt in (("reward", reward), ("kl", kl), ("objective", objective), ("optimum", optimum),
                             ("gap", optimum - objective)):
        out[name], out[f"{name}_se"] = mean_se(per_prompt)
    return out


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean of per-prompt values and its standard error (0 for a single value)."""
    array = np.asarray(values, dtype=np.float64)
    se = float(array.std(ddof=1) / np.sqrt(array.size)) if array.size > 1 else 0.0
    return float(array.mean()), se
