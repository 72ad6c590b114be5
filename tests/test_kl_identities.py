"""The KL identities of docs/concepts/theory.md, checked by exact enumeration through compute_loss (float64).

The KL part of an expected gradient is (E[grad loss] - E[grad loss with no KL]) / beta; RLOO keeps
the policy-gradient part linear in the reward, so the difference isolates the KL term exactly.
"""

from dataclasses import replace

import pytest
import torch
from rounding import assert_equal_to_rounding

from trainer import config as run_config
from trainer.audits import tabular
from trainer.audits.audit import audit_configs, gradient_audit
from trainer.audits.enumeration import (
    AuditInstance,
    expectation,
    expected_gradient,
    group_gradients,
    rel_error,
    target_gradients,
    variance,
)
from trainer.objective import estimators, kl
from trainer.objective.loss import ObjectiveConfig, compute_loss
from trainer.rollout.hf import sampling_logprobs

TOL = 1e-6
BETA = 0.1
# (vocab, length, group size): the theory's instance and two more shapes.
SHAPES = [(3, 2, 2), (2, 3, 2), (2, 2, 3)]
BASE = ObjectiveConfig(placement="none", beta=BETA, advantage="rloo")


def kl_part(inst, estimator, placement, group_size, off_policy=False, kl_loss_ratio="none"):
    config = replace(BASE, estimator=estimator, placement=placement, kl_loss_ratio=kl_loss_ratio)
    with_kl = expected_gradient(inst, config, group_size, off_policy)
    without = expected_gradient(inst, BASE, group_size, off_policy)
    return (with_kl - without) / BETA


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"V{s[0]}-T{s[1]}-G{s[2]}")
def case(request):
    vocab, length, group_size = request.param
    inst = AuditInstance.random(vocab, length, seed=7)
    assert float(inst.rewards.min()) > 0  # non-zero rewards: the policy-gradient part is live
    return inst, group_size, target_gradients(inst)


def test_none_is_exactly_the_policy_gradient_of_expected_reward(case):
    inst, group_size, targets = case
    grad = expected_gradient(inst, BASE, group_size, off_policy=False)
    assert rel_error(grad, -targets["reward"]) < TOL


@pytest.mark.parametrize("estimator,placement", [("k1", "reward"), ("k1", "reward+loss"), ("k3", "reward+loss"),
                                                 ("full", "reward+loss")])
def test_unbiased_configurations_give_grad_kl(case, estimator, placement):
    inst, group_size, targets = case
    assert rel_error(kl_part(inst, estimator, placement, group_size), targets["unbiased"]) < TOL


def test_k1_loss_gives_zero(case):
    inst, group_size, targets = case
    assert kl_part(inst, "k1", "loss", group_size).norm() < TOL * targets["unbiased"].norm()


def test_k2_loss_is_per_prefix_reverse_kl(case):
    inst, group_size, targets = case
    grad = kl_part(inst, "k2", "loss", group_size)
    assert rel_error(grad, targets["per-prefix reverse"]) < TOL
    assert rel_error(grad, targets["unbiased"]) > 1e-3  # biased for T > 1


def test_k3_loss_is_per_prefix_forward_kl(case):
    inst, group_size, targets = case
    grad = kl_part(inst, "k3", "loss", group_size)
    assert rel_error(grad, targets["per-prefix forward"]) < TOL
    assert rel_error(grad, targets["unbiased"]) > 1e-3


@pytest.mark.parametrize("ratio", ["none", "differentiable"])
def test_full_loss_is_per_prefix_reverse_kl_and_full_reward_is_the_rest_of_grad_kl(case, ratio):
    """The chain rule of KL: grad E[sum_t KL_t] = E[sum_t grad KL_t] (the loss: each prefix's KL with the
    prefix distribution held fixed) + E[sum_t KL_t grad log pi(y_<t)] (the reward: the score of the
    prefixes). A token ratio adds E[KL_t grad log pi(y_t)] = 0: KL_t does not depend on y_t."""
    inst, group_size, targets = case
    loss = kl_part(inst, "full", "loss", group_size, kl_loss_ratio=ratio)
    assert rel_error(loss, targets["per-prefix reverse"]) < TOL
    reward = kl_part(inst, "full", "reward", group_size)
    assert rel_error(reward, targets["unbiased"] - targets["per-prefix reverse"]) < TOL
    assert rel_error(kl_part(inst, "full", "reward+loss", group_size, kl_loss_ratio=ratio), targets["unbiased"]) < TOL


@pytest.mark.parametrize("estimator", ["k2", "k3", "full"])
def test_reward_placement_of_k2_k3_and_full_is_biased(case, estimator):
    inst, group_size, targets = case
    grad = kl_part(inst, estimator, "reward", group_size)
    for target in ("unbiased", "per-prefix reverse", "per-prefix forward"):
        assert rel_error(grad, targets[target]) > 1e-2


def test_k3_reward_is_grad_kl_minus_the_k3_loss_term(case):
    inst, group_size, targets = case
    grad = kl_part(inst, "k3", "reward", group_size)
    assert rel_error(grad, targets["unbiased"] - targets["per-prefix forward"]) < TOL


def test_k2_reward_plus_loss_is_the_gradient_of_expected_k2(case):
    inst, group_size, targets = case
    space = inst.space
    ref_token_logp = space.token_logp(inst.ref_logits)
    theta = inst.logits.clone().requires_grad_(True)
    token_logp = space.token_logp(theta)
    expected_k2 = (token_logp.sum(-1).exp() * (0.5 * (token_logp - ref_token_logp) ** 2).sum(-1)).sum()
    (grad_expected_k2,) = torch.autograd.grad(expected_k2, theta)
    grad = kl_part(inst, "k2", "reward+loss", group_size)
    assert rel_error(grad, grad_expected_k2) < TOL
    assert rel_error(grad, targets["unbiased"]) > 1e-2


# --- off-policy weighting of the KL loss -------------------------------------------------------

def _sampled_batch(inst, group_size, n_groups, seed):
    gen = torch.Generator().manual_seed(seed)
    probs = inst.space.seq_logp(inst.behaviour_logits).exp()
    return torch.multinomial(probs, group_size * n_groups, replacement=True, generator=gen)


def _batch_gradient(inst, rows, group_size, config, behaviour):
    space = inst.space
    theta = inst.logits.clone().requires_grad_(True)
    logp = space.token_logp(theta)[rows]
    old = space.token_logp(inst.behaviour_logits)[rows] if behaviour else None
    mask = torch.ones_like(logp)
    from trainer.objective.loss import compute_loss
    loss, _ = compute_loss(logp, space.token_logp(inst.ref_logits)[rows], old, inst.rewards[rows], mask,
                           group_size, config)
    (grad,) = torch.autograd.grad(loss, theta)
    return grad


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("placement", ["loss", "reward+loss"])
def test_detached_weight_changes_nothing_on_policy(estimator, placement):
    inst = AuditInstance.random(3, 3, seed=3)
    rows = _sampled_batch(inst, 4, 3, seed=0)
    plain = replace(BASE, estimator=estimator, placement=placement)
    detached = replace(plain, kl_loss_ratio="detached")
    assert torch.equal(_batch_gradient(inst, rows, 4, plain, False), _batch_gradient(inst, rows, 4, detached, False))


def test_differentiable_weight_turns_k3_loss_into_k2_loss_on_policy():
    inst = AuditInstance.random(3, 3, seed=4)
    rows = _sampled_batch(inst, 4, 3, seed=1)
    k3_diff = replace(BASE, estimator="k3", placement="loss", kl_loss_ratio="differentiable")
    k2_plain = replace(BASE, estimator="k2", placement="loss")
    g3 = _batch_gradient(inst, rows, 4, k3_diff, False)
    g2 = _batch_gradient(inst, rows, 4, k2_plain, False)
    assert rel_error(g3, g2) < 1e-12  # the same for every sample, not only in expectation
    assert rel_error(_batch_gradient(inst, rows, 4, replace(k3_diff, kl_loss_ratio="none"), False), g2) > 1e-3


@pytest.mark.parametrize("group_size", [2, 3])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("placement", ["none", "reward", "loss", "reward+loss"])
def test_detached_weight_recovers_on_policy_gradient_for_one_token_responses(estimator, placement, group_size):
    inst = AuditInstance.random(3, 1, seed=5)  # (the reward's KL from pi itself: from mu it is another term)
    config = replace(BASE, estimator=estimator, placement=placement, kl_loss_ratio="detached", reward_kl="current")
    off = expected_gradient(inst, config, group_size, off_policy=True)
    on = expected_gradient(inst, replace(config, kl_loss_ratio="none"), group_size, off_policy=False)
    assert rel_error(off, on) < TOL


def test_token_level_ratios_leave_longer_responses_biased_and_the_audit_says_by_how_much():
    one_token = gradient_audit(vocab=3, length=1, group_size=2, seeds=(0,), progress=False)
    two_tokens = gradient_audit(vocab=3, length=2, group_size=2, seeds=(0,), progress=False)

    def detached_rows(result):
        return [r for r in result.rows if r.sampling == "off-policy" and r.kl_loss_ratio == "detached"]

    assert all(r.err_on_policy < TOL for r in detached_rows(one_token))
    assert one_token.pg_error["off-policy"] < TOL
    # k1-loss stays exactly zero under the detached weight; every other loss term is shifted
    shifted = [r for r in detached_rows(two_tokens) if (r.estimator, r.placement) != ("k1", "loss")]
    assert shifted and all(r.err_on_policy > 1e-2 for r in shifted)
    assert two_tokens.pg_error["off-policy"] > 1e-2


SEQUENCE = {"pg_ratio": "sequence", "reward_kl": "current"}


def sequence_kl_part(inst, estimator, placement, group_size, cap=None, reward_kl="current"):
    """The KL part of the expected gradient off-policy, under the sequence-level weights."""
    base = replace(BASE, pg_ratio="sequence", sequence_ratio_cap=cap, reward_kl=reward_kl)
    ratio = "none" if placement == "reward" else "sequence"
    config = replace(base, estimator=estimator, placement=placement, kl_loss_ratio=ratio)
    return (expected_gradient(inst, config, group_size, True) - expected_gradient(inst, base, group_size, True)) / BETA


def test_the_sequence_ratio_makes_the_policy_gradient_exactly_unbiased_off_policy(case):
    inst, group_size, targets = case
    grad = expected_gradient(inst, replace(BASE, **SEQUENCE), group_size, off_policy=True)
    assert rel_error(grad, -targets["reward"]) < 1e-10
    token_ratios = expected_gradient(inst, BASE, group_size, off_policy=True)
    assert rel_error(token_ratios, -targets["reward"]) > 1e-3


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "full"])
@pytest.mark.parametrize("placement", ["reward", "loss", "reward+loss"])
def test_sequence_and_prefix_ratios_give_every_configuration_its_on_policy_gradient_off_policy(
        case, estimator, placement):
    """Exactly, for any length: the policy gradient weighted by pi(y)/mu(y) and each KL-loss token by
    its prefix ratio (docs/concepts/theory.md, "What is exactly unbiased off-policy"); so k1-reward,
    k1-reward+loss, k3-reward+loss and full-reward+loss are exactly unbiased off-policy."""
    inst, group_size, targets = case
    off = sequence_kl_part(inst, estimator, placement, group_size)
    on = kl_part(inst, estimator, placement, group_size)
    assert float((off - on).norm() / targets["unbiased"].norm()) < 1e-10  # (k1-loss's is exactly zero)
    if (estimator, placement) in (("k1", "reward"), ("k1", "reward+loss"), ("k3", "reward+loss"),
                                  ("full", "reward+loss")):
        assert rel_error(off, targets["unbiased"]) < TOL


def test_the_samplers_kl_in_the_reward_pulls_away_from_the_sampler_by_exactly_grad_kl_to_it(case):
    """With mu's log-ratio in the reward (reward_kl sampler, verl's choice), the k1-reward term's expected
    gradient is grad KL(pi || pi_ref) - grad KL(pi || mu) under sequence weights: why exactness off-policy
    needs reward_kl current (docs/full_kl.md)."""
    inst, group_size, targets = case
    space = inst.space
    theta = inst.logits.clone().requires_grad_(True)
    (to_sampler,) = torch.autograd.grad(tabular.sequence_kl(space, theta, space.seq_logp(inst.behaviour_logits)), theta)
    got = sequence_kl_part(inst, "k1", "reward", group_size, reward_kl="sampler")
    assert rel_error(got, targets["unbiased"] - to_sampler) < 1e-10
    assert rel_error(got, targets["unbiased"]) > 1e-2


@pytest.mark.parametrize("advantage, grpo_scale, exact", [
    ("rloo", True, True), ("drgrpo", True, True), ("reinforce", True, True), ("grpo", False, True),
    ("grpo", True, False)])
def test_sequence_weights_are_exact_with_advantages_whose_baseline_is_a_mean(advantage, grpo_scale, exact):
    """A sample's weight corrects its own distribution only; a baseline that is a mean of the group's
    rewards keeps E_mu[w_i A_i grad log pi_i] equal to its on-policy value, GRPO's std scaling does not."""
    inst = AuditInstance.random(3, 2, seed=0)
    config = replace(BASE, estimator="k3", placement="reward+loss", advantage=advantage, grpo_scale=grpo_scale)
    off = expected_gradient(inst, replace(config, kl_loss_ratio="sequence", **SEQUENCE), 2, off_policy=True)
    assert (rel_error(off, expected_gradient(inst, config, 2, off_policy=False)) < 1e-10) == exact


def test_truncating_the_sequence_ratios_biases_what_it_cuts(case):
    inst, group_size, targets = case
    assert rel_error(sequence_kl_part(inst, "k3", "reward+loss", group_size, cap=1e12), targets["unbiased"]) < TOL
    assert rel_error(sequence_kl_part(inst, "k3", "reward+loss", group_size, cap=1.2), targets["unbiased"]) > 1e-3


@pytest.mark.parametrize("placement", ["reward", "loss", "reward+loss"])
def test_sequence_ratios_are_exactly_one_on_policy(placement):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-2.0, -0.2], [-1.0, -1.0]], dtype=torch.float64)
    ref = logp - torch.tensor([[0.3, -0.2], [0.1, 0.0], [-0.4, 0.25], [0.2, -0.1]], dtype=torch.float64)
    rewards, mask = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64), torch.ones(4, 2, dtype=torch.float64)
    results = []
    for config in (replace(BASE, estimator="k3", placement=placement),
                   replace(BASE, estimator="k3", placement=placement, kl_loss_ratio="sequence", **SEQUENCE)):
        theta = logp.clone().requires_grad_()
        loss, stats = compute_loss(theta, ref, None, rewards, mask, 2, config)
        loss.backward()
        results.append((loss.detach(), theta.grad, stats))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[1][2]["seq_ratio_mean"] == 1.0 and results[1][2]["seq_ratio_max"] == 1.0


def test_audit_verdicts_agree_with_kl_theory_and_rank_the_unbiased_by_their_exact_variance():
    # docs/concepts/theory.md, "What each configuration differentiates" (the per-token KL
    # rewards and k3+: tests/test_peers_kl.py)
    result = gradient_audit(vocab=3, length=2, group_size=2, seeds=(0, 1), progress=False,
                            only_estimators=("k1", "k2", "k3", "full"),
                            only_placements=("reward", "loss", "reward+loss"))
    on_policy = [r for r in result.rows if r.sampling == "on-policy"]
    assert len(on_policy) == 20
    assert all(r.agrees is not False for r in on_policy), [(r.estimator, r.placement, r.verdict) for r in on_policy]
    assert sum(r.agrees is True for r in on_policy) == 16
    assert result.pg_error["on-policy"] < TOL
    # docs/concepts/audits.md's answer to "which unbiased configuration is least noisy": the same mean, k3's
    # control variate in the loss takes most of the KL part's variance away; k1-loss's zero mean
    # comes with noise of its own, which it adds to k1-reward.
    sequence = [r for r in result.rows if r.pg_ratio == "sequence"]
    assert len(sequence) == 12 and all(r.agrees for r in sequence), [(r.estimator, r.placement, r.verdict)
                                                                    for r in sequence]
    assert {(r.estimator, r.placement) for r in sequence if r.verdict == "unbiased"} == {
        ("k1", "reward"), ("k1", "reward+loss"), ("k3", "reward+loss"), ("full", "reward+loss")}
    assert result.pg_error["off-policy, sequence ratio"] < TOL < result.pg_error["off-policy"]
    var = {(r.estimator, r.placement): r.var_kl for r in on_policy if r.kl_loss_ratio == "none"}
    assert var["full", "reward+loss"] < var["k3", "reward+loss"] / 2  # no sampling noise at the token
    assert var["k3", "reward+loss"] < var["k1", "reward"] / 2 < var["k1", "reward+loss"] / 2
    assert var["k1", "loss"] > 0.1 and all(r.var_grad > 0 for r in result.rows)


@pytest.mark.parametrize("off_policy", [False, True])
def test_group_gradients_are_the_exact_distribution_of_one_groups_gradient(off_policy):
    """Their mean is the expected gradient (computed in one backward pass); their variance is the
    trace of the probability-weighted covariance; sampling groups at those probabilities agrees."""
    inst = AuditInstance.random(3, 2, seed=0)
    config = replace(BASE, estimator="k3", placement="reward+loss")
    grads, weights = group_gradients(inst, config, 2, off_policy)
    # each weight the exp of a sum of 2 x 2 token log-probs (none larger than token_logp); 81 weights summed
    token_logp = float(inst.space.token_logp(inst.behaviour_logits if off_policy else inst.logits).abs().max())
    assert len(weights) == 81
    assert_equal_to_rounding(weights.sum(), 1.0, max(1.0, token_logp), count=81 + 2 * 2 + 1)
    assert rel_error(expectation(grads, weights), expected_gradient(inst, config, 2, off_policy)) < 1e-12
    flat = grads.flatten(1)
    exact = variance(grads, weights)
    assert exact == pytest.approx(float(torch.cov(flat.T, correction=0, aweights=weights).trace()), rel=1e-10)
    draws = torch.multinomial(weights, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    sampled = flat[draws]
    assert float(((sampled - sampled.mean(0)) ** 2).sum(-1).mean()) == pytest.approx(exact, rel=0.02)


@pytest.mark.parametrize("config, off_policy, engine_mismatch", [
    (replace(BASE, estimator="k3", placement="reward+loss"), False, False),
    (replace(BASE, estimator="k2", placement="loss", kl_loss_ratio="differentiable", clip_ratio_c=3.0), True, False),
    (replace(BASE, estimator="k1", placement="reward-to-go", pg_ratio="sequence"), True, False),
    (replace(BASE, estimator="full", placement="loss", kl_loss_ratio="differentiable"), True, False),
    (replace(BASE, estimator="k3", placement="loss", entropy_coef=0.01, advantage="grpo"), False, False),
    (replace(BASE, estimator="k3", placement="reward-centred", tis_cap=2.0), False, True),
], ids=["on-policy", "dual-clip", "sequence-ratio", "full", "entropy-grpo", "engine-tis"])
def test_vectorized_gradients_are_those_of_one_backward_pass_per_group(config, off_policy, engine_mismatch,
                                                                         monkeypatch):
    """The audits take every group's loss and gradient in one torch.func.vmap call; a loss that cannot be
    vectorized is taken group by group. Both give the same gradients (to rounding), and the configurations
    the audits check take the vectorized call."""
    inst = AuditInstance.random(2, 3, seed=3)
    real_vmap, vectorized = torch.func.vmap, []

    def spy(*args, **kwargs):
        batched = real_vmap(*args, **kwargs)

        def call(*inputs):
            result = batched(*inputs)
            vectorized.append(True)
            return result
        return call

    def refuse(*args, **kwargs):
        raise RuntimeError("not vectorizable")

    monkeypatch.setattr(torch.func, "vmap", spy)
    grads, weights = group_gradients(inst, config, 2, off_policy, engine_mismatch=engine_mismatch)
    mean = expected_gradient(inst, config, 2, off_policy, engine_mismatch=engine_mismatch)
    assert vectorized == [True, True]
    monkeypatch.setattr(torch.func, "vmap", refuse)
    one_by_one, same_weights = group_gradients(inst, config, 2, off_policy, engine_mismatch=engine_mismatch)
    assert torch.equal(weights, same_weights) and grads.shape == one_by_one.shape
    assert float((grads - one_by_one).abs().max()) <= 1e-12 * float(one_by_one.abs().max())
    assert rel_error(mean, expected_gradient(inst, config, 2, off_policy, engine_mismatch=engine_mismatch)) < 1e-12
    assert rel_error(expectation(grads, weights), mean) < 1e-12


def test_one_token_audit_merges_coinciding_targets():
    """For T = 1 the per-prefix reverse KL is the sequence KL: k2-loss is unbiased there."""
    result = gradient_audit(vocab=3, length=1, group_size=2, seeds=(0,), progress=False)
    row = next(r for r in result.rows if (r.sampling, r.estimator, r.placement, r.kl_loss_ratio)
               == ("on-policy", "k2", "loss", "none"))
    assert row.verdict == "unbiased = per-prefix reverse"


def test_prefix_probabilities_sum_to_one_per_depth():
    space = tabular.SequenceSpace(3, 3)
    logits = space.random_logits(torch.Generator().manual_seed(0))
    reach = space.prefix_probs(logits)
    size = float(torch.log_softmax(logits, -1).abs().max())  # products of softmaxes of these logits
    assert reach[0] == 1.0
    assert_equal_to_rounding(reach[1:4].sum(), 1.0, size, count=3 + 1)
    assert_equal_to_rounding(reach[4:13].sum(), 1.0, size, count=9 + 2)
    assert_equal_to_rounding(space.seq_logp(logits).exp().sum(), 1.0, size, count=27 + 3 + 1)


def test_a_new_estimator_is_one_registration_that_the_config_the_trainer_and_the_audit_pick_up(monkeypatch):
    """Registering an estimator (here k1 scaled by 2, with its theory: twice grad KL, grad KL scaled) makes it
    a valid config choice, a loss the trainer computes, and audit rows whose verdicts are checked
    against the registered theory."""
    monkeypatch.setattr(estimators.REGISTRY, "_specs", dict(estimators.REGISTRY._specs))  # undone after the test
    estimators.REGISTRY.register(estimators.Estimator(
        "k1x2", "2 l", formula=lambda lr, bound: 2 * lr,
        theory={("reward", "none"): "scaled", ("loss", "none"): "zero", ("reward+loss", "none"): "scaled"}))
    config = ObjectiveConfig(estimator="k1x2", placement="reward", beta=BETA)
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    assert torch.equal(kl.estimate("k1x2", logp, logp - 0.5), torch.full((1, 2), 1.0, dtype=torch.float64))
    assert ("on-policy", "k1x2", "reward+loss", "none", "token") in audit_configs()
    inst = AuditInstance.random(3, 2, seed=0)
    targets = target_gradients(inst)
    assert rel_error(kl_part(inst, "k1x2", "reward", 2), 2 * targets["unbiased"]) < TOL
    result = gradient_audit(vocab=3, length=2, group_size=2, seeds=(0,), progress=False)
    rows = [r for r in result.rows if r.estimator == "k1x2" and r.sampling == "on-policy" and r.theory]
    assert len(rows) == 3 and all(r.agrees for r in rows), [(r.placement, r.verdict) for r in rows]
    assert config.needs_full_kl is False


def test_full_kl_terms_take_the_ratio_of_their_prefix_alone_exact_and_less_noisy(monkeypatch):
    """KL_t depends on y_<t only, so its off-policy weight stops at t - 1 (a weight through y_t would be
    exact as well, with one more token ratio's noise): the registration's token_dependent=False."""
    inst = AuditInstance.random(3, 2, seed=0)
    targets = target_gradients(inst)
    config = replace(BASE, estimator="full", placement="reward+loss", kl_loss_ratio="sequence", **SEQUENCE)
    base = replace(BASE, **SEQUENCE)

    def kl_part_and_variance():
        grads, weights = group_gradients(inst, config, 2, off_policy=True)
        base_grads, _ = group_gradients(inst, base, 2, off_policy=True)
        return (expectation(grads, weights) - expectation(base_grads, weights)) / BETA, \
            variance((grads - base_grads) / BETA, weights)

    before_t, variance_before_t = kl_part_and_variance()
    specs = dict(estimators.REGISTRY._specs)
    specs["full"] = replace(specs["full"], token_dependent=True)
    monkeypatch.setattr(estimators.REGISTRY, "_specs", specs)
    through_t, variance_through_t = kl_part_and_variance()
    assert rel_error(before_t, targets["unbiased"]) < 1e-10 and rel_error(through_t, targets["unbiased"]) < 1e-10
    assert variance_before_t < 0.95 * variance_through_t


@pytest.mark.parametrize("config", [
    replace(BASE, estimator="k1", placement="reward"),
    replace(BASE, estimator="k3", placement="reward+loss", kl_loss_ratio="sequence", **SEQUENCE),
], ids=["k1-reward", "k3-reward+loss-sequence-weights"])
def test_top_p_sampling_biases_every_gradient_whatever_the_behaviour_policy(config):
    """Samples from the nucleus of pi (top-p 0.7, as the hf engine draws them): taken for pi's (strictly
    on-policy, the ratio 1) or weighted by the truncated log-probs as the behaviour policy's (token or
    sequence ratios), neither the policy gradient nor the KL part is the true one. A weight cannot bring
    back the sequences the sampler never draws: why rollout.top_p < 1 is a config error."""
    inst = AuditInstance.random(3, 2, seed=0)
    targets = target_gradients(inst)
    base = replace(BASE, pg_ratio=config.pg_ratio)
    for top_p, biased in ((1.0, False), (0.7, True)):
        sampled = replace(inst, behaviour_logits=sampling_logprobs(inst.logits, 1.0, top_p))
        for reading in ({"off_policy": False, "engine_mismatch": True}, {"off_policy": True}):
            pg = expected_gradient(sampled, base, 2, **reading)
            kl_grad = (expected_gradient(sampled, config, 2, **reading) - pg) / BETA
            errors = rel_error(pg, -targets["reward"]), rel_error(kl_grad, targets["unbiased"])
            assert min(errors) > 0.2 if biased else max(errors) < 1e-10, (top_p, reading, errors)


def test_top_p_below_one_is_a_config_error():
    with pytest.raises(run_config.ConfigError, match=r"rollout.top_p: 0.7 < 1 samples from the nucleus .*docs/top_p"):
        run_config.load(None, ["model.path=any", "rollout.top_p=0.7"])
    assert run_config.load(None, ["model.path=any", "rollout.top_p=1.0"]).rollout.top_p == 1.0
