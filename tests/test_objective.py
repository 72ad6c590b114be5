"""compute_loss and ObjectiveConfig: aggregation, hand-computed losses, statistics, bad input."""

import math

import pytest
import torch
from rounding import assert_same_statistic, rounding

from trainer.objective.loss import ObjectiveConfig, aggregate, combine_stats, compute_loss

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize("loss_agg,expected", [
    ("token-mean", 7 / 3),                  # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-sum", 3.5),            # (3 + 4) / 2 responses
    ("seq-mean-token-mean", 2.75),          # (3/2 + 4/1) / 2
    ("seq-mean-token-sum-norm", 3.5 / 4),   # (3 + 4) / 2 / norm_length 4
])
def test_each_loss_aggregation_on_a_hand_computed_case(loss_agg, expected):
    assert aggregate(PER_TOKEN, MASK, loss_agg, norm_length=4).item() == pytest.approx(expected)


def test_the_sequence_length_aggregation_counts_the_prompts_tokens_and_its_parts_add_up():
    """seq-mean-token-sum-seq-len (the Comedy paper's fork): each token sum over prompt + response tokens, then the
    mean over responses; micro-batches of rows, each with the whole batch's totals, add up to the whole."""
    prompts = torch.tensor([3.0, 1.0], dtype=torch.float64)
    whole = aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-seq-len", prompt_lengths=prompts)
    assert whole.item() == pytest.approx((3 / (3 + 2) + 4 / (1 + 1)) / 2, rel=1e-15)
    parts = [aggregate(PER_TOKEN[i:i + 1], MASK[i:i + 1], "seq-mean-token-sum-seq-len", totals=(2, 3),
                       prompt_lengths=prompts[i:i + 1]) for i in range(2)]
    assert float(sum(parts)) == pytest.approx(whole.item(), rel=1e-15)
    with pytest.raises(ValueError, match="seq-mean-token-sum-seq-len: aggregate needs prompt_lengths"):
        aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-seq-len")
    config = ObjectiveConfig(placement="none", loss_agg="seq-mean-token-sum-seq-len")
    logp = torch.full((2, 3), -1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="objective.loss_agg: compute_loss needs prompt_lengths"):
        compute_loss(logp, logp, None, torch.tensor([1.0, 0.0], dtype=torch.float64), MASK, 2, config)
    with pytest.raises(ValueError, match=r"prompt_lengths must have shape \[2\]"):
        compute_loss(logp, logp, None, torch.tensor([1.0, 0.0], dtype=torch.float64), MASK, 2, config,
                     prompt_lengths=prompts[:1])


def _batch():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-2.0, -0.2], [-1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -2.5], [-1.0, -0.2], [-2.0, -1.0]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    return logp, ref, rewards, mask


def test_loss_value_on_a_hand_computed_case():
    """k1 in reward and k3 in loss, RLOO, on-policy: every number written out."""
    logp, ref, rewards, mask = _batch()
    beta = 0.1
    l = (logp - ref) * mask
    k1_seq = l.sum(-1)                                   # [-0.5, 0.0, -1.0, 1.0]
    shaped = rewards - beta * k1_seq                     # [1.05, 0.0, 0.6, 0.9]
    adv = torch.stack([shaped[0] - shaped[1], shaped[1] - shaped[0], shaped[2] - shaped[3], shaped[3] - shaped[2]])
    pg = -(adv.unsqueeze(-1) * mask).sum(-1).mean()      # ratio = 1 on-policy
    k3 = (torch.exp(-(logp - ref)) - 1 + (logp - ref)) * mask
    expected = pg + beta * k3.sum(-1).mean()

    config_r = ObjectiveConfig(estimator="k1", placement="reward", beta=beta)
    loss_r, stats = compute_loss(logp, ref, None, rewards, mask, 2, config_r)
    assert loss_r.item() == pytest.approx(pg.item(), rel=1e-12)
    assert stats["kl_k1"] == pytest.approx(k1_seq.mean().item())
    assert stats["reward_shaped_mean"] == pytest.approx(shaped.mean().item())
    assert stats["kl_k3"] == pytest.approx(k3.sum(-1).mean().item())

    # k3 in the loss, k1 in the reward: not a placement klstudy offers, so add the two by hand
    config_l = ObjectiveConfig(estimator="k3", placement="loss", beta=beta)
    loss_l, _ = compute_loss(logp, ref, None, rewards, mask, 2, config_l)
    pg_raw = -(torch.stack([rewards[0] - rewards[1], rewards[1] - rewards[0], rewards[2] - rewards[3],
                            rewards[3] - rewards[2]]).unsqueeze(-1) * mask).sum(-1).mean()
    assert loss_l.item() == pytest.approx((pg_raw + beta * k3.sum(-1).mean()).item(), rel=1e-12)
    assert expected.item() == pytest.approx(pg.item() + beta * k3.sum(-1).mean().item())


def test_without_statistics_the_loss_and_its_gradient_are_the_same():
    """stats=False (what the audits ask) skips the statistics, never the loss: the same value and gradient,
    bit for bit, for every placement, on- and off-policy with TIS."""
    logp, ref, rewards, mask = _batch()
    for placement in ("reward", "loss", "reward+loss", "none"):
        for old, tis in ((None, None), (logp.detach() - 0.1, 2.0)):
            config = ObjectiveConfig(estimator="k3", placement=placement, beta=0.1, tis_cap=tis)
            engine = None if tis is None else logp.detach() - 0.2
            results = []
            for stats in (True, False):
                theta = logp.detach().clone().requires_grad_(True)
                loss, found = compute_loss(theta, ref, old, rewards, mask, 2, config, engine_logp=engine, stats=stats)
                (grad,) = torch.autograd.grad(loss, theta)
                results.append((loss.detach(), grad, found))
            (loss_a, grad_a, found_a), (loss_b, grad_b, found_b) = results
            assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
            assert found_a and found_b == {}


def test_placement_none_ignores_beta():
    logp, ref, rewards, mask = _batch()
    a, _ = compute_loss(logp, ref, None, rewards, mask, 2, ObjectiveConfig(placement="none", beta=0.0))
    b, _ = compute_loss(logp, ref, None, rewards, mask, 2, ObjectiveConfig(placement="none", beta=5.0))
    assert a.item() == b.item()


INERT_ALTERNATIVES = {"estimator": "k2", "beta": 5.0, "kl_loss_ratio": "differentiable", "grpo_scale": False,
                      "norm_length": 7, "clip_eps_high": 0.5, "clip_eps": 0.1, "sequence_ratio_cap": 1.5}


@pytest.mark.parametrize("placement", ["none", "reward", "loss", "reward+loss"])
@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
@pytest.mark.parametrize("loss_agg", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_inert_fields_change_nothing_and_the_others_change_the_loss(placement, advantage, loss_agg, clip_eps):
    """What a study relies on to cross an axis only where it means something: off-policy (so every
    ratio matters), changing a field the config calls inert leaves the loss and its gradient exactly
    as they were; changing one it does not call inert changes them."""
    from dataclasses import replace

    logp, ref, rewards, mask = _batch()
    old = logp - torch.tensor([[0.3, -0.2], [0.1, 0.0], [-0.4, 0.25], [0.2, -0.1]], dtype=torch.float64)
    config = ObjectiveConfig(estimator="k3", placement=placement, beta=0.1, advantage=advantage, loss_agg=loss_agg,
                             norm_length=4, clip_eps=clip_eps, clip_eps_high=0.3 if clip_eps else None,
                             kl_loss_ratio="detached")

    def loss_and_grad(objective):
        theta = logp.clone().requires_grad_()
        loss, _ = compute_loss(theta, ref, old, rewards, mask, 2, objective)
        loss.backward()
        return loss.detach(), theta.grad

    loss, grad = loss_and_grad(config)
    inert = config.inert_fields()
    for name, value in INERT_ALTERNATIVES.items():
        if name == "clip_eps_high" and clip_eps is None:
            continue  # not inert but invalid: the config refuses it without clip_eps
        changed_loss, changed_grad = loss_and_grad(replace(config, **{name: value}))
        same = torch.equal(changed_loss, loss) and torch.equal(changed_grad, grad)
        assert same == (name in inert), (name, sorted(inert))


def test_ratio_clipping_and_its_statistics():
    logp, ref, rewards, mask = _batch()
    old = logp.clone()
    old[0, 0] -= math.log(1.5)   # ratio 1.5 on a token with a positive advantage: clipped at 1.2
    old[3, 1] += math.log(2.0)   # ratio 0.5, advantage +0.5: the unclipped term is the larger loss, kept
    config = ObjectiveConfig(placement="none", clip_eps=0.2)
    theta = logp.clone().requires_grad_(True)
    loss, stats = compute_loss(theta, ref, old, rewards, mask, 2, config)
    loss.backward()
    assert stats["clip_frac"] == pytest.approx(1 / 7)
    assert stats["ratio_max"] == pytest.approx(1.5)
    assert stats["ratio_min"] == pytest.approx(0.5)
    assert theta.grad[0, 0].item() == 0.0  # a clipped token gets no gradient
    assert theta.grad[3, 1].item() != 0.0


def test_dual_clip_bounds_the_loss_of_negative_advantages_under_any_staleness():
    """A stale token (ratio e^100) with a negative advantage: the plain PPO term overflows float32 and
    the update is lost; the dual clip bounds it at clip_ratio_c x |A| with no gradient there, and
    leaves positive advantages and in-bound ratios alone."""
    logp, ref, rewards, mask = (x.float() for x in _batch())
    old = logp.clone()
    old[1, 0] -= 100.0  # advantage of row 1 is negative (reward 0 against 1 in its group)
    old[0, 0] -= math.log(1.5)  # positive advantage: the dual clip does not apply
    old[2, 1] -= math.log(2.0)  # row 2's advantage is negative too, but its ratio 2 < 3: unchanged
    plain = ObjectiveConfig(placement="none", clip_eps=0.2)
    dual = ObjectiveConfig(placement="none", clip_eps=0.2, clip_ratio_c=3.0)
    assert not torch.isfinite(compute_loss(logp, ref, old, rewards, mask, 2, plain)[0])
    theta = logp.clone().requires_grad_(True)
    loss, stats = compute_loss(theta, ref, old, rewards, mask, 2, dual)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(theta.grad).all()
    assert theta.grad[1, 0].item() == 0.0 and theta.grad[2, 1].item() != 0.0 and theta.grad[0, 0].item() == 0.0
    assert stats["dual_clip_frac"] == pytest.approx(1 / 7)
    unstale = old.clone()
    unstale[1, 0] = logp[1, 0]
    a, _ = compute_loss(logp, ref, unstale, rewards, mask, 2, plain)
    b, stats = compute_loss(logp, ref, unstale, rewards, mask, 2, dual)
    assert a.item() == b.item() and stats["dual_clip_frac"] == 0.0


def test_the_dual_clip_changes_the_policy_gradient_and_the_kl_in_the_reward_off_policy_only():
    """Exact enumeration (the audit's machinery) with a tight bound (1.2) that bites: on-policy it
    changes nothing; off-policy it biases the policy gradient and every configuration with the KL in
    the reward (whose gradient flows through the advantages), never a KL that is only in the loss."""
    from dataclasses import replace

    from trainer.audits.enumeration import AuditInstance, expected_gradient, rel_error

    inst = AuditInstance.random(vocab=3, length=2, seed=0)
    for placement in ("none", "reward", "loss", "reward+loss"):
        for off_policy in (False, True):
            config = ObjectiveConfig(estimator="k3", placement=placement, beta=0.1)
            plain = expected_gradient(inst, config, 2, off_policy)
            dual = expected_gradient(inst, replace(config, clip_ratio_c=1.2), 2, off_policy)
            if not off_policy:
                assert rel_error(dual, plain) < 1e-12, placement
            elif placement == "loss":  # the KL part alone: (grad - pg) is untouched
                none = replace(config, placement="none")
                kl_plain = plain - expected_gradient(inst, none, 2, True)
                kl_dual = dual - expected_gradient(inst, replace(none, clip_ratio_c=1.2), 2, True)
                assert rel_error(kl_dual, kl_plain) < 1e-12
            else:
                assert rel_error(dual, plain) > 1e-3, placement


def test_stats_are_plain_floats_and_count_clamped_tokens():
    logp, ref, rewards, mask = _batch()
    logp = logp.float()
    ref = ref.float()
    logp[3, 1] = -500.0  # k3's exponent overflows float32 on this token
    k3_loss = ObjectiveConfig(estimator="k3", placement="loss")
    _, stats = compute_loss(logp, ref, None, rewards.float(), mask, 2, k3_loss)
    assert all(type(v) is float for v in stats.values())
    assert stats["kl_clamped_tokens"] == 1.0
    assert math.isfinite(stats["kl_k3"])
    _, stats_k1 = compute_loss(logp, ref, None, rewards.float(), mask, 2, ObjectiveConfig(estimator="k1"))
    assert stats_k1["kl_clamped_tokens"] == 0.0
    assert set(stats) >= {"kl_k1", "kl_k3", "adv_mean", "adv_std", "ratio_mean", "clip_frac", "kl_clamped_tokens"}


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_the_statistics_of_a_batch_split_into_parts_are_the_whole_batchs(tis_cap):
    """Micro-batches and processes each see part of a minibatch; their combined statistics must be
    those of the whole. Parts of unequal rows and tokens, ratios that clip: averaging clip_frac or
    adv_std over the parts, as combine_stats once did, is off here."""
    generator = torch.Generator().manual_seed(0)
    rows, length, group = 12, 6, 2
    logp = -torch.rand(rows, length, generator=generator, dtype=torch.float64) * 2
    old = logp + torch.randn(rows, length, generator=generator, dtype=torch.float64) * 0.4
    engine = old + torch.randn(rows, length, generator=generator, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(rows, length, generator=generator, dtype=torch.float64) * 0.5
    rewards = torch.rand(rows, generator=generator, dtype=torch.float64) * 3
    lengths = torch.tensor([6, 1, 2, 5, 6, 6, 3, 1, 4, 6, 2, 5])
    mask = (torch.arange(length) < lengths[:, None]).double()
    config = ObjectiveConfig(estimator="k3", placement="reward+loss", beta=0.1, clip_eps=0.1, tis_cap=tis_cap)
    totals = (rows, float(mask.sum()))

    def stats(part):
        return compute_loss(logp[part], ref[part], old[part], rewards[part], mask[part], group, config, totals,
                            engine[part])[1]

    whole = stats(slice(None))
    combined = combine_stats([stats(slice(a, b)) for a, b in ((0, 2), (2, 8), (8, 12))])
    assert 0 < whole["clip_frac"] < 1
    assert combined.keys() == {key for key in whole if not key.startswith("_")}
    # a statistic that is 0 in exact arithmetic (RLOO's mean advantage) is rounding of sums over the batch's
    # numbers: rewards, log-probs and the ratios between them
    size = max([float(x.abs().max()) for x in (logp, old, engine, ref, rewards)]
               + [float((a - b).abs().max().exp()) for a, b in ((logp, old), (old, engine), (logp, ref))])
    for key, value in combined.items():
        assert_same_statistic(key, whole[key], value, 1e-9, rounding(size, int(mask.sum())))


@pytest.mark.parametrize("kwargs,match", [
    ({"estimator": "k4"}, r"objective.estimator: 'k4' is not one of k1, k2, k3"),
    ({"placement": "advantage"}, r"objective.placement: .* none, reward, loss, reward\+loss"),
    ({"advantage": "ppo"}, r"objective.advantage: 'ppo' is not one of rloo, grpo, drgrpo, reinforce"),
    ({"loss_agg": "sum"}, r"objective.loss_agg"),
    ({"kl_loss_ratio": "clipped"},
     r"objective.kl_loss_ratio: 'clipped' is not one of none, detached, differentiable, sequence"),
    ({"beta": -0.1}, r"objective.beta: must be a finite number >= 0"),
    ({"beta": float("nan")}, r"objective.beta"),
    ({"beta": "0.1"}, r"objective.beta: must be a number"),
    ({"loss_agg": "seq-mean-token-sum-norm"}, r"objective.norm_length"),
    ({"clip_eps": 0.0}, r"objective.clip_eps"),
    ({"clip_eps": 1.5}, r"objective.clip_eps: must be < 1"),
    ({"clip_eps_high": 0.3}, r"objective.clip_eps_high: set clip_eps too"),
    ({"pg_ratio": "prefix"}, r"objective.pg_ratio: 'prefix' is not one of token, sequence"),
    ({"pg_ratio": "sequence", "ratio_cap": 8.0}, r"objective.ratio_cap: bounds token ratios, and pg_ratio seq"),
    ({"pg_ratio": "sequence", "clip_ratio_c": 3.0}, r"objective.clip_ratio_c: bounds token ratios"),
    ({"ratio_cap": 0.5}, r"objective.ratio_cap: must be None or a number >= 1"),
    ({"ratio_cap": 8.0, "ratio_floor": 2.0}, r"objective.ratio_floor: must be None or a number in \(0, 1\]"),
    ({"ratio_floor": 0.5}, r"objective.ratio_floor: shapes the bounds of the token ratio; set ratio_cap"),
    ({"ratio_cap": 8.0, "ratio_mode": "drop"}, r"objective.ratio_mode: 'drop' is not one of truncate, mask"),
    ({"kl_loss_agg": "sum"}, r"objective.kl_loss_agg: 'sum' is not one of"),
    ({"kl_loss_agg": "seq-mean-token-sum-norm"}, r"objective.norm_length: seq-mean-token-sum-norm needs"),
    ({"sequence_ratio_cap": 0.5}, r"objective.sequence_ratio_cap: must be None or a number >= 1"),
])
def test_bad_config_values_give_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveConfig(**kwargs)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        ObjectiveConfig().beta = 1.0  # type: ignore[misc]


def test_mismatched_shapes_give_clear_errors():
    logp, ref, rewards, mask = _batch()
    config = ObjectiveConfig()
    with pytest.raises(ValueError, match="ref_logp has shape"):
        compute_loss(logp, ref[:, :1], None, rewards, mask, 2, config)
    with pytest.raises(ValueError, match="rewards must have shape"):
        compute_loss(logp, ref, None, rewards[:3], mask, 2, config)
    with pytest.raises(ValueError, match="not a whole number of groups of 3"):
        compute_loss(logp, ref, None, rewards, mask, 3, config)
    with pytest.raises(ValueError, match="old_logp has shape"):
        compute_loss(logp, ref, logp[:2], rewards, mask, 2, config)


# --- truncated importance sampling against the rollout engine (objective.tis_cap) ---------------

def _loss_and_grad(logp, ref, old, rewards, mask, config, engine=None):
    theta = logp.clone().requires_grad_(True)
    loss, stats = compute_loss(theta, ref, old, rewards, mask, 2, config, engine_logp=engine)
    loss.backward()
    return loss.detach(), theta.grad, stats


@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_tis_is_the_identity_when_the_engine_is_exact(off_policy, clip_eps):
    """The engine's log-probs equal the trainer's (old_logp, or pi_theta on-policy): weight 1."""
    logp, ref, rewards, mask = _batch()
    old = logp - 0.3 * torch.tensor([[1.0, -1.0], [0.5, 0.0], [-0.2, 0.4], [0.1, 0.1]], dtype=torch.float64)
    old = old if off_policy else None
    base = ObjectiveConfig(estimator="k3", placement="reward+loss", beta=0.1, clip_eps=clip_eps)
    exact_engine = logp if old is None else old
    loss, grad, _ = _loss_and_grad(logp, ref, old, rewards, mask, base)
    tis_loss, tis_grad, stats = _loss_and_grad(logp, ref, old, rewards, mask,
                                               ObjectiveConfig(**{**base.__dict__, "tis_cap": 2.0}), exact_engine)
    assert tis_loss.item() == loss.item() and torch.equal(tis_grad, grad)
    assert stats["tis_weight_mean"] == 1.0 and stats["tis_weight_min"] == 1.0 and stats["tis_truncated_frac"] == 0.0


def test_tis_weights_and_truncates_each_token():
    logp, ref, rewards, mask = _batch()
    engine = logp.clone()
    engine[0, 0] += math.log(2.0)   # the engine made this token twice as likely: weight 1/2
    engine[2, 1] -= math.log(5.0)   # five times less likely: weight 5, truncated at 2
    config = ObjectiveConfig(placement="none", tis_cap=2.0)
    _, grad, stats = _loss_and_grad(logp, ref, None, rewards, mask, config, engine)
    _, plain, _ = _loss_and_grad(logp, ref, None, rewards, mask, ObjectiveConfig(placement="none"))
    expected = plain.clone()
    expected[0, 0] *= 0.5
    expected[2, 1] *= 2.0
    assert torch.allclose(grad, expected)
    assert stats["tis_truncated_frac"] == pytest.approx(1 / 7) and stats["tis_weight_min"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tis_cap: compute_loss needs engine_logp"):
        compute_loss(logp, ref, None, rewards, mask, 2, config)
    with pytest.raises(ValueError, match="tis_cap: must be None or a number >= 1"):
        ObjectiveConfig(tis_cap=0.5)


def test_tis_makes_an_inexact_engine_exactly_unbiased_for_one_token_responses():
    """Exact enumeration: samples from an engine mu != pi that the trainer takes for on-policy.
    Uncorrected, the policy gradient is E_mu[A grad log pi], biased; untruncated TIS gives exactly
    E_pi[A grad log pi] (RLOO's baseline stays independent of each sample). Longer responses get
    token ratios, which are only a first-order correction (docs/concepts/theory.md, "Engine weights:
    TIS and IcePop"): biased there."""
    from trainer.audits.enumeration import AuditInstance, expected_gradient, rel_error

    base = ObjectiveConfig(placement="none", advantage="rloo")
    untruncated = ObjectiveConfig(placement="none", advantage="rloo", tis_cap=1e12)
    one_token = AuditInstance.random(vocab=4, length=1, seed=3, behaviour_shift=1.0)
    exact = expected_gradient(one_token, base, 2, off_policy=False)
    assert rel_error(expected_gradient(one_token, untruncated, 2, False, engine_mismatch=True), exact) < 1e-10
    assert rel_error(expected_gradient(one_token, base, 2, False, engine_mismatch=True), exact) > 0.05
    two_tokens = AuditInstance.random(vocab=3, length=2, seed=3, behaviour_shift=1.0)
    exact = expected_gradient(two_tokens, base, 2, off_policy=False)
    assert rel_error(expected_gradient(two_tokens, untruncated, 2, False, engine_mismatch=True), exact) > 1e-3
