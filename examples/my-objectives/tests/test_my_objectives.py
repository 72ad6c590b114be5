"""The package's own tests: its choices are registered, and compute what they say."""

import torch

from trainer.objective import estimators, kl_loss_ratios, loss_aggs, plugins


def test_the_entry_point_registers_every_choice():
    assert "my_objectives" in plugins.load()
    assert "k1x2" in estimators.sampled_estimators()
    assert "half" in kl_loss_ratios.REGISTRY and "batch-sum" in loss_aggs.REGISTRY


def test_k1x2_is_twice_k1():
    l = torch.tensor([0.3, -0.2, 0.0])
    k1, k1x2 = estimators.REGISTRY["k1"], estimators.REGISTRY["k1x2"]
    assert torch.equal(k1x2.formula(l, 20.0), 2 * k1.formula(l, 20.0))
