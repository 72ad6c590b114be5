"""Advantage estimators on hand-computed cases."""

import pytest
import torch
from rounding import assert_equal_to_rounding

from trainer.objective import advantages

REWARDS = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)


def test_rloo_subtracts_the_mean_of_the_others():
    assert advantages.rloo(REWARDS, 2).tolist() == [-1.0, 1.0, -3.0, 3.0]
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]
    assert_equal_to_rounding(advantages.rloo(REWARDS, 4), torch.tensor(expected, dtype=torch.float64), 6.0, count=4)


def test_drgrpo_subtracts_the_group_mean():
    assert advantages.drgrpo(REWARDS, 2).tolist() == [-0.5, 0.5, -1.5, 1.5]
    assert_equal_to_rounding(advantages.drgrpo(REWARDS, 4), advantages.rloo(REWARDS, 4) * 3 / 4, 6.0, count=8)


def test_grpo_divides_by_the_unbiased_group_std():
    std = 2**0.5 / 2  # std of [1, 2] and half of [3, 6]'s
    expected = [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4), -1.5 / (3 * std + 1e-4), 1.5 / (3 * std + 1e-4)]
    assert torch.allclose(advantages.grpo(REWARDS, 2), torch.tensor(expected, dtype=torch.float64))
    assert advantages.grpo(REWARDS, 2, scale=False).tolist() == advantages.drgrpo(REWARDS, 2).tolist()


def test_reinforce_is_the_reward():
    assert advantages.reinforce(REWARDS, 2).tolist() == REWARDS.tolist()


def test_reinforce_plus_plus_divides_the_group_centred_rewards_by_their_std_over_the_whole_batch():
    centred = torch.tensor([-0.5, 0.5, -1.5, 1.5], dtype=torch.float64)
    expected = centred / (centred.std() + 1e-4)
    assert torch.allclose(advantages.reinforce_plus_plus(REWARDS, 2), expected)
    # a batch-scope estimator: its first group's values depend on the other group (why the trainer
    # computes advantages once per minibatch, over every process's rows)
    assert not torch.allclose(advantages.reinforce_plus_plus(REWARDS[:2], 2), expected[:2])
    assert advantages.REGISTRY["reinforce++"].scope == "batch"
    batch = {spec.name for spec in advantages.REGISTRY if spec.scope == "batch"}
    assert batch == {"reinforce++"} | {spec.name for spec in advantages.REGISTRY if spec.whiten is not None}


def test_the_registry_refuses_a_second_registration_of_a_name():
    with pytest.raises(ValueError, match="advantage 'rloo' is registered twice"):
        advantages.REGISTRY.register(advantages.Advantage("rloo", advantages.rloo))


def test_equal_rewards_give_zero_advantage():
    flat = torch.full((6,), 0.7, dtype=torch.float64)
    for name in ("rloo", "grpo", "drgrpo", "reinforce++"):
        # the centred rewards' rounding, divided by the std's floor 1e-4 where the estimator scales
        size = 0.7 / 1e-4 if name in ("grpo", "reinforce++") else 0.7
        assert_equal_to_rounding(advantages.compute(name, flat, 3), torch.zeros(6, dtype=torch.float64), size,
                                 count=6, msg=name)


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="not a whole number of groups of 3"):
        advantages.rloo(REWARDS, 3)
    with pytest.raises(ValueError, match="rloo needs group_size >= 2"):
        advantages.rloo(REWARDS, 1)
    with pytest.raises(ValueError, match="shape"):
        advantages.drgrpo(REWARDS.view(2, 2), 2)
    with pytest.raises(ValueError, match=r"unknown advantage 'ppo'.*rloo, grpo, drgrpo, reinforce, reinforce\+\+"):
        advantages.compute("ppo", REWARDS, 2)
