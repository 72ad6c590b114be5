"""The objective's pieces added to reproduce the peers and the Comedy paper's own runs, by hand-computed cases and
by exact enumeration on tabular policies: whitening the advantages, the KL-loss term's own aggregation, the bounded
token ratio, the clipped sequence ratio, the group-centred KL in the reward (docs/peers.md)."""

from dataclasses import replace

import pytest
import torch

from trainer.audits import coefficients
from trainer.audits.audit import verdict
from trainer.audits.enumeration import AuditInstance, expected_gradient, rel_error, target_gradients
from trainer.objective import whitening
from trainer.objective.loss import ObjectiveConfig, batch_advantages, compute_loss

BETA = 0.1
BASE = ObjectiveConfig(placement="none", beta=BETA, advantage="rloo", reward_kl="current")
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)


# --- whitening ---------------------------------------------------------------------------------------------------

def test_whitening_standardises_over_the_response_tokens_as_each_library_does():
    values = torch.tensor([[1.0, 2.0, 4.0], [3.0, 99.0, 99.0]], dtype=torch.float64)  # 99: padding, never read
    tokens = torch.tensor([1.0, 2.0, 4.0, 3.0], dtype=torch.float64)
    mean, n = tokens.mean(), 4
    population = ((tokens - mean) ** 2).mean()
    got = whitening.whiten(values, MASK, whitening.POPULATION)
    assert torch.allclose(got[0], (values[0] - mean) / population.sqrt(), rtol=1e-14)
    # verl's masked_whiten: the mean over n + 1e-8, the sample variance, rsqrt(var + 1e-8)
    mean_v = tokens.sum() / (n + 1e-8)
    sample = ((tokens - mean_v) ** 2).sum() / (n + 1e-8) * n / (n - 1)
    got = whitening.whiten(values, MASK, whitening.SAMPLE)
    assert torch.allclose(got[0], (values[0] - mean_v) / (sample + 1e-8).sqrt(), rtol=1e-14)
    # a response's value is on each of its tokens: a longer response weighs more in the mean and variance
    per_response = whitening.whiten(torch.tensor([1.0, 3.0], dtype=torch.float64), MASK, whitening.POPULATION)
    three = torch.tensor([1.0, 1.0, 1.0, 3.0], dtype=torch.float64)
    assert float(per_response[1, 0]) == pytest.approx(float((3.0 - three.mean()) / three.std(unbiased=False)))


def test_a_whitening_advantage_whitens_the_return_with_its_kl():
    """verl's REINFORCE++ (and GAE with no critic): the return R - beta sum_{s>=t} k_s, whitened; klstudy's
    reinforce-whiten with the KL to go is that, and differs from the unwhitened advantage."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    kl = torch.tensor([[0.2, -0.1, 0.3], [0.5, 0.0, 0.0], [0.1, 0.1, 0.1], [-0.2, 0.4, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    config = ObjectiveConfig(estimator="k1", placement="reward-to-go", beta=0.3, advantage="reinforce-whiten")
    to_go = kl.flip(-1).cumsum(-1).flip(-1)
    expected = whitening.whiten(rewards.unsqueeze(-1) - 0.3 * to_go, mask, whitening.SAMPLE)
    got = batch_advantages(rewards, kl * mask, 2, config, mask).values
    assert torch.allclose(got * mask, expected * mask, rtol=1e-14)
    with pytest.raises(ValueError, match="needs the response mask to whiten over"):
        batch_advantages(rewards, kl, 2, config)


def test_with_one_group_per_batch_whitening_makes_the_group_baseline_irrelevant():
    """The batch's mean is subtracted anyway: drgrpo-whiten and reinforce-whiten give the same advantages on a
    batch of one group, and different ones on a batch of two."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.float64)
    kl = torch.tensor([0.2, -0.4, 0.1, 0.3], dtype=torch.float64)
    config = ObjectiveConfig(estimator="k1", placement="reward", beta=0.3)
    one = [batch_advantages(rewards[:2], kl[:2], 2, replace(config, advantage=a), mask[:2]).values
           for a in ("reinforce-whiten", "drgrpo-whiten")]
    two = [batch_advantages(rewards, kl, 2, replace(config, advantage=a), mask).values
           for a in ("reinforce-whiten", "drgrpo-whiten")]
    assert torch.allclose(one[0], one[1], rtol=1e-13) and not torch.allclose(two[0], two[1])


def test_whitening_is_biased_exactly_and_leaves_no_objective_of_the_form_E_R_minus_beta_KL():
    """By enumeration: the whitened return's expected gradient is no a (-grad E[R]) + b grad KL (a batch statistic
    that depends on the sample divides it), where the unwhitened one is E[R] - beta KL exactly."""
    rows = {(r.advantage, r.placement): r for r in coefficients.coefficient_rows(
        [("reinforce", "k1", "reward-to-go"), ("reinforce-whiten", "k1", "reward-to-go"),
         ("reinforce-whiten-pop", "k1", "reward-to-go"), ("drgrpo", "k1", "reward-to-go")], seeds=(0,),
        progress=False)}
    assert rows["reinforce", "reward-to-go"].verdict == "exact"
    assert rows["reinforce-whiten", "reward-to-go"].verdict == "biased" and rows[
        "reinforce-whiten", "reward-to-go"].bias > 0.1
    # the two variances differ by n / (n - 1) on every batch of one size (and by where their 1e-8 goes, which
    # counts on the batches whose returns are nearly equal): the same objective, at another step size
    pop, sample = rows["reinforce-whiten-pop", "reward-to-go"], rows["reinforce-whiten", "reward-to-go"]
    assert pop.beta_ratio == pytest.approx(sample.beta_ratio, rel=1e-4)
    assert pop.reward_weight / sample.reward_weight == pytest.approx((4 / 3) ** 0.5, rel=1e-4)
    # drgrpo centres R and not the KL to go: the reward's weight is (G - 1) / G, the KL's 1
    assert rows["drgrpo", "reward-to-go"].verdict == "rescaled"
    assert rows["drgrpo", "reward-to-go"].beta_ratio == pytest.approx(2.0, rel=1e-9)


# --- the KL-loss term's own aggregation ---------------------------------------------------------------------------

def test_the_kl_loss_has_its_own_aggregation_as_skyrl_averages_it_per_response():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.2], [-0.4, -1.0, -1.0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    config = ObjectiveConfig(estimator="k3", placement="loss", beta=0.5, advantage="reinforce", loss_agg="token-mean",
                             kl_loss_agg="seq-mean-token-mean")
    loss, stats = compute_loss(logp, ref, None, rewards, MASK, 1, config)
    loss = loss.detach()
    l = (logp - ref).detach()
    k3 = (torch.exp(-l) - 1 + l) * MASK
    pg = -(rewards.unsqueeze(-1) * MASK).sum() / MASK.sum()
    kl = (k3.sum(-1) / MASK.sum(-1)).mean()
    assert float(loss) == pytest.approx(float(pg + 0.5 * kl), rel=1e-14)
    assert stats["loss_kl"] == pytest.approx(float(0.5 * kl), rel=1e-14)
    one, _ = compute_loss(logp, ref, None, rewards, MASK, 1, replace(config, kl_loss_agg=None))
    assert float(one.detach()) != pytest.approx(float(loss))  # token-mean for both: SkyRL's KL weighed otherwise
    assert "kl_loss_agg" in replace(config, placement="reward").inert_fields()


# --- the bounded token ratio -------------------------------------------------------------------------------------

def test_the_token_ratio_is_clamped_or_masked_and_loses_its_gradient_beyond_the_bounds():
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[3.0, -3.0, 0.5]], dtype=torch.float64)  # ratios e^3, e^-3, e^0.5
    ones, reward = torch.ones(1, 3, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    clamp = ObjectiveConfig(placement="none", advantage="reinforce", ratio_cap=8.0)
    loss, stats = compute_loss(logp, logp.detach(), old, reward, ones, 1, clamp)
    (grad,) = torch.autograd.grad(loss, logp)
    ratio = torch.exp(logp.detach() - old)
    assert float(loss.detach()) == pytest.approx(-float(8.0 + ratio[0, 1] + ratio[0, 2]), rel=1e-14)
    assert grad[0].tolist() == pytest.approx([0.0, -float(ratio[0, 1]), -float(ratio[0, 2])], rel=1e-14)
    assert stats["ratio_bounded_frac"] == pytest.approx(1 / 3)
    mask = replace(clamp, ratio_floor=0.125, ratio_mode="mask")  # IcePop: both tails dropped
    loss, stats = compute_loss(logp, logp.detach(), old, reward, ones, 1, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(loss.detach()) == pytest.approx(-float(ratio[0, 2]), rel=1e-14)
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, -float(ratio[0, 2])], rel=1e-14)
    assert stats["ratio_bounded_frac"] == pytest.approx(2 / 3)


def test_bounds_that_never_bind_leave_the_expected_gradient_exactly_as_it_was():
    inst = AuditInstance.random(3, 2, seed=0)
    config = replace(BASE, estimator="k1", placement="reward-centred", advantage="drgrpo")
    plain = expected_gradient(inst, config, 2, off_policy=True)
    assert torch.equal(expected_gradient(inst, replace(config, ratio_cap=1e9), 2, off_policy=True), plain)
    assert rel_error(expected_gradient(inst, replace(config, ratio_cap=1.5), 2, off_policy=True), plain) > 1e-3


# --- the clipped sequence ratio ----------------------------------------------------------------------------------

def test_the_sequence_ratio_clipped_as_trl_rloo_clips_it():
    """-min(w A, clip(w, 0.8, 1.2) A) per response, averaged over responses: a clipped response has no gradient."""
    logp = torch.tensor([[-1.0, -1.0], [-0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.3, 0.2], [0.05, -0.1]], dtype=torch.float64)  # w = e^0.5, e^-0.05
    rewards, ones = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)
    config = ObjectiveConfig(placement="none", advantage="rloo", pg_ratio="sequence", clip_eps=0.2)
    loss, stats = compute_loss(logp, logp.detach(), old, rewards, ones, 2, config)
    (grad,) = torch.autograd.grad(loss, logp)
    w = torch.exp(torch.tensor([0.5, -0.05], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    expected = -torch.minimum(w * adv, w.clamp(0.8, 1.2) * adv).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-14)
    assert grad[0].tolist() == [0.0, 0.0]  # w = 1.65 > 1.2 with A > 0: clipped
    assert grad[1].tolist() == pytest.approx([float(w[1]) / 2] * 2, rel=1e-14)  # -w A / 2 responses, per token
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_a_clip_that_never_binds_keeps_the_sequence_ratio_exactly_unbiased_and_one_that_binds_does_not():
    inst = AuditInstance.random(3, 2, seed=0)
    targets = target_gradients(inst)
    sequence = replace(BASE, pg_ratio="sequence")
    wide = expected_gradient(inst, replace(sequence, clip_eps=0.999, clip_eps_high=1e9), 2, off_policy=True)
    assert rel_error(wide, -targets["reward"]) < 1e-10
    assert rel_error(expected_gradient(inst, replace(sequence, clip_eps=0.2), 2, off_policy=True),
                     -targets["reward"]) > 1e-2


# --- the group-centred KL in the reward --------------------------------------------------------------------------

def test_the_centred_kl_is_the_current_policys_minus_the_samplers_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    current = torch.tensor([0.4, -0.2, 0.1, 0.3], dtype=torch.float64)
    sampler = torch.tensor([0.2, 0.0, 0.3, 0.5], dtype=torch.float64)
    config = ObjectiveConfig(estimator="k1", placement="reward-centred", beta=0.5, advantage="drgrpo")
    got = batch_advantages(rewards, current, 2, config, centre_kl=sampler).values
    expected = torch.tensor([0.5 - 0.5 * (0.4 - 0.1), -0.5 - 0.5 * (-0.2 - 0.1),
                             -0.25 - 0.5 * (0.1 - 0.4), 0.25 - 0.5 * (0.3 - 0.4)], dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-14)
    same = batch_advantages(rewards, current, 2, replace(config, placement="reward")).values
    assert torch.allclose(batch_advantages(rewards, current, 2, config).values, same, rtol=1e-14)  # drgrpo of R - bK


def test_the_centred_kl_is_grad_kl_scaled_by_its_groups_share_and_the_fork_follows_E_R_minus_beta_KL():
    """On-policy, exactly: with the group mean (the response's own KL included) the KL part is (G - 1) / G grad KL;
    with drgrpo's centring of R too (the fork's log Z), the whole gradient is (G - 1) / G times that of
    E[R] - beta KL: the paper's k1-reward optimises the regularised objective."""
    inst = AuditInstance.random(3, 2, seed=1)
    targets = target_gradients(inst)
    for group_size in (2, 3):
        config = replace(BASE, estimator="k1", placement="reward-centred")
        part = (expected_gradient(inst, config, group_size, False)
                - expected_gradient(inst, BASE, group_size, False)) / BETA
        assert rel_error(part, (group_size - 1) / group_size * targets["unbiased"]) < 1e-10
        assert verdict(part, targets, 1e-6) == "scaled"
        whole = coefficients.decompose(expected_gradient(inst, replace(config, advantage="drgrpo"), group_size, False),
                                       targets)
        assert whole.bias < 1e-10 and whole.beta_eff == pytest.approx(BETA, rel=1e-9)
        assert whole.reward == pytest.approx((group_size - 1) / group_size, rel=1e-9)
