"""The RL libraries' KL machinery, exactly: per-token KL rewards, k3+, clamps, the KL-loss weights engine
and score, the engine weights, the entropy bonus, adaptive beta and the refreshed reference (docs/peers.md)."""

from dataclasses import replace

import pytest
import torch

from trainer.audits import moving_targets, peers_audit, tabular
from trainer.audits.audit import gradient_audit
from trainer.audits.enumeration import AuditInstance, rel_error
from trainer.batch import HeadInputs
from trainer.objective import kl
from trainer.objective.engine_weights import engine_weights
from trainer.objective.entropy_bonus import token_entropy
from trainer.objective.kl_coefficient import KLCoefficient
from trainer.objective.loss import (
    LossRows,
    ObjectiveConfig,
    PolicyPass,
    batch_advantages,
    compute_loss,
    policy_loss,
    reward_kl,
)
from trainer.objective.reference_refresh import mix_

TOKEN_REWARDS = ("reward", "reward-to-go", "reward-to-go+loss", "reward-token")


def test_k1_to_go_is_unbiased_with_less_kl_variance_than_k1_summed_and_the_audit_agrees_with_the_theory():
    result = gradient_audit(vocab=3, length=2, group_size=2, seeds=(0, 1), progress=False,
                            only_estimators=("k1", "k3", "k3+", "full"), only_placements=TOKEN_REWARDS)
    assert all(r.agrees is not False for r in result.rows), [(r.sampling, r.estimator, r.placement, r.verdict)
                                                             for r in result.rows if r.agrees is False]
    rows = {(r.sampling, r.estimator, r.placement, r.kl_loss_ratio, r.pg_ratio): r for r in result.rows}
    to_go = rows["on-policy", "k1", "reward-to-go", "none", "token"]
    summed = rows["on-policy", "k1", "reward", "none", "token"]
    assert to_go.verdict == "unbiased" and to_go.err_kl < 1e-12
    assert to_go.var_kl < summed.var_kl / 2  # the same mean: the KL before a token only added noise
    assert rows["on-policy", "k3", "reward-to-go+loss", "none", "token"].verdict == "unbiased"
    assert rows["on-policy", "full", "reward-to-go+loss", "none", "token"].verdict == "unbiased"
    assert rows["on-policy", "k1", "reward-token", "none", "token"].verdict == "per-prefix reverse"
    assert rows["on-policy", "full", "reward-token", "none", "token"].verdict == "zero"
    assert rows["on-policy", "k3+", "reward-to-go+loss", "none", "token"].verdict == "biased"  # k3's mean, k2's slope
    assert rows["off-policy", "k1", "reward-to-go", "none", "sequence"].verdict == "unbiased"  # sequence weights


def test_single_sample_numbers_for_k1_to_go():
    """docs/peers.md, "Per-token KL rewards (placements reward-to-go, reward-to-go+loss, reward-token)": V=3,
    T=3, one sample, no baseline (reinforce, groups of 1): k1 to go is unbiased with a KL part of 0.5-0.8 of
    k1 summed's variance."""
    result = gradient_audit(vocab=3, length=3, group_size=1, seeds=(0, 1, 2), advantage="reinforce", progress=False,
                            only_estimators=("k1",), only_placements=("reward", "reward-to-go"))
    on = {r.placement: r for r in result.rows if r.sampling == "on-policy"}
    assert on["reward-to-go"].verdict == on["reward"].verdict == "unbiased"
    assert on["reward-to-go"].var_kl < 0.8 * on["reward"].var_kl


def test_per_token_kl_rewards_split_over_parts_as_one_batch():
    """Advantages [B, T] once per minibatch, then the loss of each part with the batch's totals: the parts'
    losses and gradients add up to the whole batch's."""
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(8, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    ref = -torch.rand(8, 5, generator=gen, dtype=torch.float64)
    mask = torch.ones(8, 5, dtype=torch.float64)
    mask[1, 3:] = mask[6, 2:] = 0
    rewards = torch.rand(8, generator=gen, dtype=torch.float64)
    for placement in ("reward-to-go", "reward-token", "reward-to-go+loss"):
        config = ObjectiveConfig(estimator="k3", placement=placement, beta=0.3)
        whole, _ = compute_loss(logp, ref, None, rewards, mask, 4, config)
        (grad,) = torch.autograd.grad(whole, logp)
        token_kl = reward_kl(config, logp, ref, mask)
        assert token_kl.shape == (8, 5) and float(token_kl[1, 3:].abs().sum()) == 0.0
        adv = batch_advantages(rewards, token_kl, 4, config)
        totals = (8, float(mask.sum()))
        parts = [policy_loss(PolicyPass(logp[rows]), LossRows(ref[rows], mask[rows], adv.values[rows]), config,
                             totals)[0] for rows in (slice(0, 4), slice(4, 8))]
        (part_grad,) = torch.autograd.grad(sum(parts), logp)
        assert float(sum(parts).detach()) == pytest.approx(float(whole.detach()), rel=1e-12)
        assert torch.allclose(part_grad, grad, rtol=1e-12, atol=1e-14)


def test_clamps_bound_the_estimate_zero_its_gradient_beyond_and_are_counted():
    logp = torch.tensor([[-1.0, -30.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -2.0]], dtype=torch.float64)
    value = kl.estimate("k3", logp, ref, log_ratio_clamp=20.0, value_clamp=10.0)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    assert float(value[0, 1].detach()) == 10.0 and float(grad[0, 1]) == 0.0  # l = -29: clamped to -20, k3 to 10
    assert torch.equal(value[0, [0, 2]], kl.estimate("k3", logp, ref)[0, [0, 2]])  # untouched inside the bounds
    assert kl.clamped("k3", logp, ref, 20.0, 10.0).tolist() == [[False, True, False]]
    config = ObjectiveConfig(estimator="k3", placement="loss", beta=0.1, kl_log_ratio_clamp=20.0, kl_value_clamp=10.0)
    _, stats = compute_loss(logp, ref, None, torch.ones(1), torch.ones(1, 3), 1, replace(config, advantage="reinforce"))
    assert stats["kl_clamped_tokens"] == 1.0


def test_clamps_act_where_each_library_puts_them():
    """verl's k3+ clamps the value it reports, never k2's gradient; NeMo-RL clamps the weighted term, and a
    token whose log-ratio clamp binds contributes no gradient, its weight's included."""
    logp = torch.tensor([[-1.0, -30.0, -6.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0]], dtype=torch.float64)
    value = kl.estimate("k3+", logp, ref, log_ratio_clamp=20.0, value_clamp=10.0)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    l = (logp - ref).detach()
    assert torch.equal(value.detach(), kl.estimate("k3", logp, ref, 20.0, 10.0).detach())
    assert torch.allclose(grad, l)  # k2's gradient l everywhere, clamps or not
    ones, config = torch.ones(1, 3, dtype=torch.float64), ObjectiveConfig(
        estimator="k3", placement="loss", beta=1.0, advantage="reinforce", kl_loss_ratio="score",
        kl_log_ratio_clamp=20.0, kl_value_clamp=10.0)
    loss, _ = compute_loss(logp, ref, None, torch.zeros(1), ones, 1, config)
    (grad,) = torch.autograd.grad(loss, logp)
    k3 = kl.estimate("k3", logp.detach(), ref)
    assert float(grad[0, 1]) == 0.0 and float(grad[0, 2]) == 0.0  # log-ratio clamped; weighted value past 10
    assert float(grad[0, 0]) == pytest.approx(float(k3[0, 0] + 1 - torch.exp(-l[0, 0])))  # (k + c) grad log pi


def test_the_engine_and_score_weights_are_the_differentiable_one_on_policy_with_an_exact_engine():
    gen = torch.Generator().manual_seed(1)
    ref = -torch.rand(4, 3, generator=gen, dtype=torch.float64)
    mask, rewards = torch.ones(4, 3, dtype=torch.float64), torch.rand(4, generator=gen, dtype=torch.float64)
    grads = {}
    for ratio in ("differentiable", "engine", "score"):
        logp = (-torch.rand(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)).requires_grad_()
        config = ObjectiveConfig(estimator="k3", placement="loss", beta=0.2, kl_loss_ratio=ratio)
        loss, _ = compute_loss(logp, ref, None, rewards, mask, 2, config, engine_logp=logp.detach())
        grads[ratio] = torch.autograd.grad(loss, logp)[0]
    assert torch.allclose(grads["engine"], grads["differentiable"], rtol=1e-12)
    assert torch.allclose(grads["score"], grads["differentiable"], rtol=1e-12)
    with pytest.raises(ValueError, match="objective.kl_loss_ratio: compute_loss needs engine_logp"):
        compute_loss(logp, ref, None, rewards, mask, 2, ObjectiveConfig(placement="loss", kl_loss_ratio="engine"))


def test_engine_weights_truncate_mask_and_weigh_sequences():
    old = torch.log(torch.tensor([[2.0, 0.25, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64))
    engine = torch.zeros_like(old)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)

    def weights(**values):
        return engine_weights(old, engine, mask, ObjectiveConfig(tis_cap=1.5, **values)).weights

    assert weights().tolist()[0] == [1.5, 0.25, 1.0]                                      # TIS: capped
    assert weights(tis_floor=0.5).tolist()[0] == [1.5, 0.5, 1.0]                          # and floored
    assert weights(tis_floor=0.5, tis_mode="mask").tolist()[0] == [0.0, 0.0, 1.0]         # IcePop: dropped
    assert weights(tis_level="sequence").tolist() == [[0.5] * 3, [1.0] * 3]               # the product, 2 x 0.25
    assert weights(tis_level="sequence", tis_mode="mask", tis_floor=0.6).tolist() == [[0.0] * 3, [1.0] * 3]
    # geometric mean of the first response: (0.5)^(1/3) = 0.79, inside [0.5, 1.5]: kept, with its token ratios
    assert weights(tis_level="geometric", tis_mode="mask", tis_floor=0.5).tolist()[0] == [2.0, 0.25, 1.0]
    assert weights(tis_level="geometric", tis_mode="mask", tis_floor=0.9).tolist()[0] == [0.0, 0.0, 0.0]


def test_the_entropy_bonus_is_the_exact_entropy_with_its_gradient():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    entropy = token_entropy(HeadInputs(hidden, weight, None), temperature=0.7, chunk=2)
    logp = torch.log_softmax(hidden @ weight.T / 0.7, -1)
    naive = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(entropy, naive, atol=1e-12)
    for mine, theirs in zip(torch.autograd.grad(entropy.sum(), (hidden, weight)),
                            torch.autograd.grad(naive.sum(), (hidden, weight)), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-12)


def test_the_peers_settings_differentiate_what_docs_peers_says():
    rows = {(r.label, r.sampling): r for r in peers_audit.additions_audit(seeds=(0,), progress=False)}
    assert all(r.agrees is not False for r in rows.values()), [(k, r.verdict) for k, r in rows.items()
                                                               if r.agrees is False]
    clamps = rows["k3 loss, clamps 20 / 10 (verl, SkyRL, NeMo-RL)", "on-policy"]
    assert clamps.verdict == "per-prefix forward" and clamps.clamped == 0.0  # the peers' clamps never bind here
    tight = rows["k3 loss, log-ratio clamped at 0.3", "on-policy"]
    assert tight.verdict == "biased" and tight.clamped > 0.3
    assert rows["entropy_coef 0.1", "on-policy"].verdict == "per-prefix entropy"
    assert rows["sequence weight, untruncated", "engine mismatch"].verdict == "exact"
    assert rows["token TIS, cap 2 (verl, slime)", "engine mismatch"].verdict == "biased"
    assert rows["k3 loss, engine", "on-policy"].verdict == "per-prefix reverse"


def test_adaptive_beta_follows_the_libraries_controller_and_its_state_round_trips():
    config = ObjectiveConfig(beta=0.1, kl_target=0.5, kl_horizon=100)
    coefficient = KLCoefficient(config)
    coefficient.update(current_kl=1.0, responses=10)   # error clipped to +0.2: x (1 + 0.2 x 10 / 100)
    assert coefficient.value == pytest.approx(0.1 * 1.02)
    coefficient.update(current_kl=0.45, responses=10)  # error -0.1
    assert coefficient.value == pytest.approx(0.1 * 1.02 * 0.99)
    assert coefficient.objective(config).beta == coefficient.value
    again = KLCoefficient(config)
    again.load_state_dict(coefficient.state_dict())
    assert again.value == coefficient.value
    fixed = KLCoefficient(ObjectiveConfig(beta=0.1))
    fixed.update(3.0, 10)
    assert fixed.value == 0.1


def test_a_refreshed_reference_is_mixed_in_parameter_by_parameter():
    reference, policy = [torch.zeros(3)], [torch.ones(3)]
    mix_(reference, policy, 0.6)
    assert reference[0].tolist() == pytest.approx([0.6] * 3)
    mix_(reference, policy, 1.0)
    assert reference[0].tolist() == [1.0] * 3


def test_moving_targets_end_at_the_final_betas_optimum_and_a_refreshed_reference_leaves_the_original():
    rows = {r.label.split(" (")[0].split(" every")[0]: r
            for r in moving_targets.moving_targets_audit(steps=200, groups_per_step=16, progress=False)}
    fixed, adaptive = rows["fixed beta"], rows["adaptive beta"]
    assert adaptive.final_beta != fixed.final_beta == 0.3
    assert adaptive.kl_to_optimum_final_beta < adaptive.kl_to_optimum_start_beta / 2
    assert rows["reference copied"].kl_to_reference > 5 * fixed.kl_to_reference
    assert rows["reference mixed in, alpha 0.6,"].kl_to_optimum_start_beta > 100 * fixed.kl_to_optimum_start_beta


@pytest.mark.parametrize("values,message", [
    ({"kl_log_ratio_clamp": 0}, "objective.kl_log_ratio_clamp: must be None or a number > 0"),
    ({"kl_value_clamp": -1.0}, "objective.kl_value_clamp: must be None or a number > 0"),
    ({"kl_target": 0.1}, "objective.kl_horizon: the adaptive coefficient needs both"),
    ({"kl_horizon": 100}, "objective.kl_target: the adaptive coefficient needs both"),
    ({"ref_refresh_every": 0}, "objective.ref_refresh_every: must be None or an integer >= 1"),
    ({"ref_refresh_alpha": 0.5}, "objective.ref_refresh_alpha: mixes the policy into the reference"),
    ({"ref_refresh_every": 5, "ref_refresh_alpha": 1.5}, "objective.ref_refresh_alpha: must be in (0, 1]"),
    ({"entropy_coef": -0.1}, "objective.entropy_coef: must be a finite number >= 0"),
    ({"tis_floor": 0.5}, "objective.tis_floor: shapes the engine weights of tis_cap; set tis_cap too"),
    ({"tis_cap": 2.0, "tis_floor": 1.5}, "objective.tis_floor: must be None or a number in (0, 1]"),
    ({"tis_cap": 2.0, "tis_level": "geometric"}, "objective.tis_level: geometric masks whole responses"),
    ({"tis_cap": 2.0, "tis_mode": "drop"}, "objective.tis_mode: 'drop' is not one of truncate, mask"),
    ({"estimator": "full", "kl_value_clamp": 10.0}, "objective.kl_value_clamp: clamps a sampled token"),
    ({"preset": "deepspeed"}, "objective.preset: 'deepspeed' is not one of verl, "),
    ({"kl_loss_ratio": "engines"}, "objective.kl_loss_ratio: 'engines' is not one of"),
    ({"kl_loss_ratio": "detached", "kl_loss_ratio_cap": 0.5}, "objective.kl_loss_ratio_cap: must be None or a number"),
    ({"kl_loss_ratio": "differentiable", "kl_loss_ratio_cap": 10.0},
     "objective.kl_loss_ratio_cap: truncates a detached token weight"),
])
def test_every_new_setting_is_validated_with_an_error_naming_its_key(values, message):
    with pytest.raises(ValueError) as error:
        ObjectiveConfig(**values)
    assert str(error.value).startswith(message)


def test_the_tabular_entropy_targets_agree_by_the_chain_rule():
    """E_pi[sum_t H_t] is the sequence entropy (the chain rule), so the two targets share a value and differ
    only in the gradient of where the prefixes go."""
    inst = AuditInstance.random(3, 2, seed=0)
    space = inst.space
    per_position = (space.seq_logp(inst.logits).exp() @ space.token_entropy(inst.logits).sum(-1))
    assert float(per_position) == pytest.approx(float(tabular.sequence_entropy(space, inst.logits)), rel=1e-12)
    assert float(tabular.prefix_entropy(space, inst.logits)) == pytest.approx(float(per_position), rel=1e-12)
    targets = peers_audit._targets(inst)
    assert rel_error(targets["per-prefix entropy"], targets["sequence entropy"]) > 0.1
