"""The per-token estimators: values, gradient coefficients, overflow, and Schulman's figures."""

import math

import pytest
import torch
from rounding import assert_equal_to_rounding

from trainer.objective import kl


def test_values_on_a_hand_computed_case():
    logp = torch.tensor([-0.5, -2.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    l = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)
    assert_equal_to_rounding(kl.estimate("k1", logp, ref), l, magnitude=2.0)
    assert_equal_to_rounding(kl.estimate("k2", logp, ref), torch.tensor([0.125, 0.5, 0.0], dtype=torch.float64),
                             magnitude=2.0, count=3)
    k3 = torch.tensor([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, 0.0], dtype=torch.float64)
    assert_equal_to_rounding(kl.estimate("k3", logp, ref), k3, magnitude=math.e, count=4)  # e^1, the largest term


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_gradient_coefficients_match_the_theory_table(estimator):
    logp = torch.linspace(-3, -0.1, 9, dtype=torch.float64).requires_grad_(True)
    ref = torch.linspace(-0.2, -4, 9, dtype=torch.float64).requires_grad_(True)
    kl.estimate(estimator, logp, ref).sum().backward()
    l = (logp - ref).detach()
    coefficient = {"k1": torch.ones_like(l), "k2": l, "k3": 1 - torch.exp(-l)}[estimator]
    assert torch.allclose(logp.grad, coefficient, rtol=1e-12, atol=1e-15)
    assert torch.allclose(ref.grad, -coefficient, rtol=1e-12, atol=1e-15)


def test_k3_is_never_negative():
    l = torch.linspace(-30, 30, 2001, dtype=torch.float64)
    assert (kl.estimate("k3", l, torch.zeros_like(l)) >= 0).all()
    l32 = torch.linspace(-1e-3, 1e-3, 2001)
    assert (kl.estimate("k3", l32, torch.zeros_like(l32)) >= 0).all()


def test_unknown_estimator_lists_the_choices():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*k1, k2, k3"):
        kl.estimate("k4", torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl.clamped("kl", torch.zeros(1), torch.zeros(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_k3_does_not_overflow_and_counts_the_clamped_tokens(dtype):
    logp = torch.tensor([-1000.0, -80.0, -1.0, -0.5], dtype=dtype).requires_grad_(True)
    ref = torch.tensor([0.0, 0.0, -0.5, -3.0], dtype=dtype)
    value = kl.estimate("k3", logp, ref)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(logp.grad).all()
    # float16's range ends at e^11: a ratio of e^80 must be clamped there, not in the wider dtypes
    expected_clamped = [True, dtype == torch.float16, False, False]
    assert kl.clamped("k3", logp, ref).tolist() == expected_clamped
    assert not kl.clamped("k1", logp, ref).any() and not kl.clamped("k2", logp, ref).any()


def test_low_precision_inputs_are_computed_in_float32():
    logp = torch.tensor([-0.3, -2.0], dtype=torch.bfloat16)
    ref = torch.tensor([-1.0, -0.1], dtype=torch.bfloat16)
    assert kl.estimate("k3", logp, ref).dtype == torch.float32


def test_clamp_leaves_gradients_unchanged_in_the_normal_range():
    """Up to |l| = 80 (probability ratios of e^80) float32 values and gradients equal the exact ones."""
    l64 = torch.linspace(-80, 80, 4001, dtype=torch.float64)
    l32 = l64.float().requires_grad_(True)
    value = kl.estimate("k3", l32, torch.zeros_like(l32))
    value.sum().backward()
    exact_value = torch.exp(-l64) - 1 + l64
    exact_grad = 1 - torch.exp(-l64)
    assert not kl.clamped("k3", l32, torch.zeros_like(l32)).any()
    # each element from l (rounded to float32 on the way in: the value moves by |1 - e^-l| |l| eps) and e^-l
    size = (1 + l64.abs()) * (1 + torch.exp(-l64))
    assert_equal_to_rounding(value, exact_value, size, count=8)
    assert_equal_to_rounding(l32.grad, exact_grad, size, count=8)


@pytest.mark.parametrize(
    "mean,bias_over_true,std_over_true",
    # Schulman, "Approximating KL Divergence": q = N(0, 1) sampled, p = N(mean, 1).
    [(0.1, {"k1": 0.0, "k2": 0.002, "k3": 0.0}, {"k1": 20.0, "k2": 1.42, "k3": 1.42}),
     (1.0, {"k1": 0.0, "k2": 0.25, "k3": 0.0}, {"k1": 2.0, "k2": 1.73, "k3": 1.7})],
)
def test_schulman_bias_and_std_on_gaussian_samples(mean, bias_over_true, std_over_true):
    n = 2_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logq = -0.5 * x**2          # sampling distribution = the policy (constants cancel)
    logp = -0.5 * (x - mean) ** 2  # the reference
    true_kl = mean**2 / 2
    samples = {name: kl.estimate(name, logq, logp) for name in kl.sampled_estimators()}
    assert torch.allclose(samples.pop("k3+"), samples["k3"], rtol=1e-12, atol=1e-12)  # k3's value: logged once
    assert set(samples) == set(kl.logged_estimators())
    for name, values in samples.items():
        std_ratio = float(values.std()) / true_kl
        assert std_ratio == pytest.approx(std_over_true[name], rel=0.02, abs=0.01), name
        if bias_over_true[name] == 0.0:  # unbiased: the sample mean is within 4 standard errors
            standard_error = float(values.std()) / math.sqrt(n)
            assert abs(float(values.mean()) - true_kl) < 4 * standard_error, name
    # k2's bias, measured against k3 on the same samples (k3 is unbiased, and k2 - k3 has tiny variance)
    difference = samples["k2"] - samples["k3"]
    bias = float(difference.mean()) / true_kl
    standard_error = float(difference.std()) / math.sqrt(n) / true_kl
    assert abs(bias - bias_over_true["k2"]) < max(4 * standard_error, 0.001)
