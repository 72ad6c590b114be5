"""The analytic optimum of E[R] - beta KL(pi || pi_ref), checked against exact enumeration."""

import math

import numpy as np
import pytest

from trainer.measure.optimum import (
    frontier,
    mean_se,
    objective_gap,
    optimal_kl,
    optimal_reward,
    optimal_value,
    reference_value,
)

RNG = np.random.default_rng(0)


def kl(p, q):
    return float(np.sum(p * (np.log(p) - np.log(q))))


def responses(rewards):
    """A reference policy over len(rewards) responses, and the reward histogram it induces."""
    ref = RNG.dirichlet(np.ones(len(rewards)))
    values = sorted(set(rewards))
    return ref, [(v, float(ref[np.array(rewards) == v].sum())) for v in values]


@pytest.mark.parametrize("rewards", [[0, 1, 0, 0, 1, 0], [0.0, 0.25, 1.0, 0.25, 0.5, 1.0, 0.0]])
@pytest.mark.parametrize("beta", [0.05, 0.3, 2.0])
def test_the_optimum_and_the_gap_identity_by_enumeration(rewards, beta):
    """pi* = pi_ref exp(R / beta) / Z is the maximiser; J* - J(pi) = beta KL(pi || pi*) for any pi."""
    ref, histogram = responses(rewards)
    r = np.array(rewards, dtype=float)
    star = ref * np.exp(r / beta)
    star /= star.sum()
    value = float(star @ r) - beta * kl(star, ref)
    assert optimal_value(histogram, beta) == pytest.approx(value, rel=1e-12)
    assert optimal_reward(histogram, beta) == pytest.approx(float(star @ r), rel=1e-12)
    assert optimal_kl(histogram, beta) == pytest.approx(kl(star, ref), rel=1e-9, abs=1e-12)
    assert reference_value(histogram) == pytest.approx(float(ref @ r), rel=1e-12)
    for _ in range(5):
        pi = RNG.dirichlet(np.ones(len(rewards)))
        objective = float(pi @ r) - beta * kl(pi, ref)
        assert optimal_value(histogram, beta) - objective == pytest.approx(beta * kl(pi, star), rel=1e-9)
        assert objective < value  # the optimum is the maximum


def test_binary_reward_closed_form_and_small_beta():
    for p in (0.01, 0.3, 0.9):
        for beta in (0.05, 0.5):
            expected = beta * math.log(1 + p * math.expm1(1 / beta))
            assert optimal_value([(0.0, 1 - p), (1.0, p)], beta) == pytest.approx(expected, rel=1e-12)
    # e^{1/beta} overflows float64 here; the log-sum-exp form stays exact: J* -> 1 + beta log p
    assert optimal_value([(0.0, 70), (1.0, 30)], 1e-3) == pytest.approx(1 + 1e-3 * math.log(0.3), rel=1e-12)
    assert optimal_value([(0.0, 5)], 0.1) == 0.0  # never rewarded: the optimum is the reference


def test_frontier_trades_kl_for_reward():
    histograms = [[(0.0, 3), (1.0, 1)], [(0.0, 1), (1.0, 1)], [(0.0, 10), (1.0, 1)]]
    points = frontier(histograms, [4.0, 1.0, 0.5, 0.1])
    kls, rewards = [k for _, k, _ in points], [r for _, _, r in points]
    assert kls == sorted(kls) and rewards == sorted(rewards)  # lower beta: further and better rewarded
    assert points[0][2] > np.mean([reference_value(h) for h in histograms])


def test_objective_gap_summary_and_standard_errors():
    histograms = [[(0.0, 1), (1.0, 1)], [(0.0, 3), (1.0, 1)], [(1.0, 4)]]
    rewards, kls, beta = [0.8, 0.5, 1.0], [0.2, 0.1, 0.0], 0.5
    out = objective_gap(histograms, rewards, kls, beta)
    optimum = [optimal_value(h, beta) for h in histograms]
    gaps = [o - (r - beta * k) for o, r, k in zip(optimum, rewards, kls, strict=True)]
    assert out["gap"] == pytest.approx(np.mean(gaps)) and out["optimum"] == pytest.approx(np.mean(optimum))
    assert out["gap_se"] == pytest.approx(np.std(gaps, ddof=1) / math.sqrt(3))
    assert out["objective"] == pytest.approx(out["reward"] - beta * out["kl"])
    assert mean_se([2.0]) == (2.0, 0.0)
    with pytest.raises(ValueError, match="one histogram, reward and KL per prompt"):
        objective_gap(histograms, rewards[:2], kls, beta)
    with pytest.raises(ValueError, match="beta must be > 0"):
        optimal_value(histograms[0], 0.0)
