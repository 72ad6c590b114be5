"""Each preset computes its library's loss and gradient, on a batch where every clamp of every preset binds: against
the library's computation written from its source (tests/peer_semantics.py), with the parts a preset leaves to the
run set as the test's RUN."""

import math

import pytest
import torch
from peer_semantics import LIBRARIES, RUN, SURROGATE_VALUES, fixed_batch
from rounding import assert_equal_to_rounding

from trainer.objective import pg_ratios, presets
from trainer.objective.loss import compute_loss
from trainer.objective.objective_config import ObjectiveConfig

BETA = 0.1  # every preset at one beta, so that the KL term counts even where the library's default is 0


def klstudy(name: str, batch, beta: float = BETA):
    """The preset's loss, its gradient and statistics on `batch`, with RUN's values for what the preset leaves open."""
    run = {key: value for key, value in RUN.items() if key not in presets.REGISTRY[name].keys}
    config = ObjectiveConfig.of_preset(name, beta=beta, **run)
    loss, stats = compute_loss(batch.logp, batch.ref, batch.old, batch.rewards, batch.mask, batch.group, config,
                               engine_logp=batch.engine, prompt_lengths=batch.prompt)
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return loss.detach(), grad, stats


def sizes(batch) -> torch.Tensor:
    """[B, T] the largest number each token's terms are computed from: its estimates (e^-l where unclamped), times
    its ratios to mu and to the engine where they weigh it up (what rounding scales with)."""
    with torch.no_grad():
        l = batch.logp - batch.ref
        estimate = 1 + l.abs() + torch.exp(-l)
        to_mu = (batch.logp - batch.old).abs()
        ratios = (1 + torch.exp(to_mu)) * (1 + torch.exp(batch.logp - batch.engine))
        return estimate * ratios * (1 + batch.rewards.abs().max())


def library(name: str, batch, beta: float = BETA):
    loss = LIBRARIES[name](batch, beta)
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return loss.detach(), grad


def test_every_preset_has_its_librarys_computation_here():
    assert set(LIBRARIES) == set(presets.NAMES)


@pytest.mark.parametrize("name", presets.NAMES)
def test_each_preset_computes_its_librarys_loss_and_gradient_where_the_clamps_bind(name):
    batch = fixed_batch()
    loss, grad, stats = klstudy(name, batch)
    expected_loss, expected_grad = library(name, batch)
    size = sizes(batch)
    if name not in SURROGATE_VALUES:  # else the library's value is another surrogate of the same gradient
        assert_equal_to_rounding(loss, expected_loss, float(size.sum()), count=64, msg=f"{name}'s loss")
    assert_equal_to_rounding(grad, expected_grad, size, count=64, msg=f"{name}'s gradient")
    config = ObjectiveConfig.of_preset(name)
    # the batch makes each preset's bounds bind, so that the test pins them too
    if config.placement != "none" and (config.kl_log_ratio_clamp or config.kl_value_clamp):
        assert stats["kl_clamped_tokens"] > 0
    if config.tis_cap is not None:
        assert stats["tis_truncated_frac"] > 0
    if config.ratio_cap is not None:
        assert stats["ratio_bounded_frac"] > 0
    if config.pg_ratio == "sequence" or pg_ratios.REGISTRY[config.pg_ratio].trust_region:
        assert stats["clip_frac"] > 0  # PPO's clip, or the trust region's mask
    if config.kl_loss_ratio_cap is not None:
        assert float((batch.logp - batch.old).detach().exp().max()) > config.kl_loss_ratio_cap


def test_open_instructs_engine_weight_has_its_floor_of_e_to_the_minus_10():
    """compute_rho_correction clamps log rho to [-10, 10] before exponentiating: on a token where pi_old / mu_engine is
    e^-12, the weight is e^-10, not e^-12."""
    from trainer.objective.engine_weights import engine_weights

    config = ObjectiveConfig.of_preset("open-instruct")
    old = torch.tensor([[-13.0, -1.0]], dtype=torch.float64)
    engine = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    weights = engine_weights(old, engine, torch.ones(1, 2, dtype=torch.float64), config).weights
    assert weights[0].tolist() == pytest.approx([math.exp(-10.0), 1.0], rel=1e-12)
