"""objective.kl_to: the KL toward the behaviour policy mu (and toward both), checked by exact enumeration and in
a run. What each estimator and weight differentiates toward mu is the peers audit's "KL to mu" section
(tests/test_peers_kl.py holds every row to its theory); here: the refused combinations, `both` as the sum of its
two terms, the gradient vanishing at pi = mu, and a trainer run."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from run_helpers import train_cli
from safetensors.torch import load_file

from trainer.audits.enumeration import AuditInstance, expected_gradient, rel_error, target_gradients
from trainer.config_error import ConfigError
from trainer.objective.loss import ObjectiveConfig
from trainer.run_files import read_metrics

BASE = ObjectiveConfig(placement="none", advantage="rloo", reward_kl="current", beta=0.1)


@pytest.mark.parametrize("values, key, says", [
    ({"kl_to": "behaviour", "placement": "reward"}, "objective.placement", "goes in the loss"),
    ({"kl_to": "behaviour", "placement": "reward+loss"}, "objective.placement", "kl_to both"),
    ({"kl_to": "behaviour", "placement": "loss", "estimator": "full"}, "objective.estimator", "no engine returns"),
    ({"kl_to": "both", "placement": "loss", "estimator": "full", "behaviour_beta": 0.1}, "objective.estimator",
     "sampled estimator"),
    ({"kl_to": "both", "placement": "reward"}, "objective.behaviour_beta", "needs the coefficient"),
    ({"kl_to": "both", "placement": "reward", "behaviour_beta": -1.0}, "objective.behaviour_beta", ">= 0"),
    ({"kl_to": "behaviour", "placement": "loss", "kl_target": 0.1, "kl_horizon": 10}, "objective.kl_target",
     "use kl_to both"),
    ({"kl_to": "behaviour", "placement": "loss", "ref_refresh_every": 5}, "objective.ref_refresh_every",
     "has none"),
    ({"kl_to": "mu"}, "objective.kl_to", "not one of reference, behaviour, both"),
    ({"kl_to": "both", "placement": "loss", "behaviour_beta": 0.1, "behaviour_estimator": "full"},
     "objective.behaviour_estimator", "no engine returns"),
    ({"kl_to": "both", "placement": "loss", "estimator": "full", "behaviour_beta": 0.1, "behaviour_estimator": "k2",
      "kl_loss_ratio": "sequence"}, "objective.behaviour_estimator", "prefix ratios"),
])
def test_the_combinations_that_mean_nothing_are_refused_by_their_key(values, key, says):
    with pytest.raises(ConfigError) as error:
        ObjectiveConfig(**values)
    assert error.value.key == key and says in error.value.message, str(error.value)


def test_both_may_estimate_the_kl_to_mu_otherwise_than_the_reference_kl():
    """kl_to both with behaviour_estimator: the reference's KL as its estimator says (full, here, with its token KL),
    mu's with its own; the sum is the two parts, exactly."""
    inst = AuditInstance.random(vocab=3, length=2, seed=2)
    gradient = lambda config: expected_gradient(inst, config, 2, True)  # noqa: E731
    reference = replace(BASE, estimator="full", placement="reward+loss")
    to_mu = replace(BASE, estimator="k2", placement="loss", kl_to="behaviour", beta=0.3)
    both = replace(reference, kl_to="both", behaviour_beta=0.3, behaviour_estimator="k2")
    none = gradient(BASE)
    assert rel_error(gradient(both) - none, (gradient(reference) - none) + (gradient(to_mu) - none)) < 1e-10


def test_without_a_kl_term_kl_to_is_inert_and_behaviour_beta_only_under_both():
    """Inert, not refused: a study crosses kl_to [reference, both] with behaviour_beta, whose reference runs leave
    it out (sweep.study.points)."""
    assert {"kl_to", "behaviour_beta"} <= ObjectiveConfig(placement="none", kl_to="behaviour").inert_fields()
    alone = ObjectiveConfig(placement="loss", kl_to="behaviour", behaviour_beta=0.3, behaviour_estimator="k3")
    assert {"behaviour_beta", "behaviour_estimator"} <= alone.inert_fields() and alone.behaviour_kl_beta == alone.beta
    both = ObjectiveConfig(placement="reward", kl_to="both", behaviour_beta=0.2)
    assert "behaviour_beta" not in both.inert_fields() and "kl_loss_ratio" not in both.inert_fields()
    assert both.behaviour_kl_beta == 0.2 and not both.reference_kl_in_loss and both.any_kl_in_loss


@pytest.mark.parametrize("placement", ["reward", "loss", "reward+loss"])
@pytest.mark.parametrize("off_policy", [False, True])
def test_both_is_the_reference_kl_plus_the_kl_to_mu_exactly(placement, off_policy):
    """Exact expected gradients: `both` = (the reference's KL as configured) + (a KL to mu with behaviour_beta),
    each measured against the run without it."""
    inst = AuditInstance.random(vocab=3, length=2, seed=4)
    gradient = lambda config: expected_gradient(inst, config, 2, off_policy)  # noqa: E731
    reference = replace(BASE, estimator="k3", placement=placement)
    to_mu = replace(BASE, estimator="k3", placement="loss", kl_to="behaviour", beta=0.3)
    both = replace(reference, kl_to="both", behaviour_beta=0.3)
    none = gradient(BASE)
    expected = (gradient(reference) - none) + (gradient(to_mu) - none)
    assert rel_error(gradient(both) - none, expected) < 1e-10


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("ratio", ["none", "detached", "differentiable", "sequence"])
def test_at_pi_equal_mu_the_kl_to_mu_has_no_expected_gradient(estimator, ratio):
    """Exactly on-policy (mu = pi, old_logp None) and off-policy with mu set to pi itself: the trust region's
    gradient vanishes in expectation, whatever the estimator and weight (k2 and k3 on every sample)."""
    inst = AuditInstance.random(vocab=3, length=2, seed=1)
    at_pi = AuditInstance(inst.space, inst.ref_logits, inst.logits, inst.logits.clone(), inst.rewards)
    config = replace(BASE, estimator=estimator, placement="loss", kl_to="behaviour", kl_loss_ratio=ratio)
    scale = float(target_gradients(inst)["unbiased"].norm())
    for case, off_policy in ((inst, False), (at_pi, True)):
        part = expected_gradient(case, config, 2, off_policy) - expected_gradient(case, BASE, 2, off_policy)
        assert float(part.norm()) < 1e-10 * scale


def test_a_run_with_the_kl_to_mu_logs_it_and_on_policy_k2_changes_no_weight(warm_model, tmp_path):
    """Two steps behind (async_level 2) the KL to mu is a loss of its own, logged each step (0 at step 0, which the
    policy it trains sampled); exactly on-policy a k2
    KL to mu is 0 with a gradient of exactly 0 on every token, so the run trains as the run without a KL does."""
    common = {"train.steps": 4, "checkpoint.every": 2}
    behind = train_cli(tmp_path / "behind", warm_model, **common, **{
        "train.async_level": 2, "objective.kl_to": "both", "objective.behaviour_beta": 0.5,
        "objective.placement": "reward", "objective.estimator": "k2", "objective.kl_loss_ratio": "detached"})
    assert behind.returncode == 0, behind.stderr[-3000:]
    lines = read_metrics(tmp_path / "behind" / "metrics.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    # step 0 is sampled by the policy it trains: mu is pi, but for the engine's rounding (mu is the engine's log-probs)
    assert lines[0]["loss_kl_behaviour"] < 1e-10 and all(line["loss_kl_behaviour"] > 1e-6 for line in lines[2:])
    runs = {}
    for name, objective in (("none", {"objective.placement": "none"}),
                            ("k2 to mu", {"objective.placement": "loss", "objective.kl_to": "behaviour",
                                          "objective.estimator": "k2"})):
        done = train_cli(tmp_path / name, warm_model, **common, **objective)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = load_file(tmp_path / name / "final" / "model.safetensors")
    assert runs["none"].keys() == runs["k2 to mu"].keys()
    assert all(torch.equal(runs["none"][k], runs["k2 to mu"][k]) for k in runs["none"])


def test_dppos_trust_region_drops_the_tokens_that_moved_beyond_it_in_the_advantages_direction():
    """pg_ratio dppo-tv (prime-rl's default): p - p_mu above clip_eps_high where A > 0, below -clip_eps where A <= 0,
    drops a token's term; inside, -rho A with rho differentiable; exactly on-policy nothing is dropped."""
    from trainer.objective import pg_ratios

    config = ObjectiveConfig(pg_ratio="dppo-tv", clip_eps=0.2, clip_eps_high=0.1, placement="none")
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    p = torch.tensor([[0.65, 0.55, 0.25, 0.35]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    logp = p.log().requires_grad_()
    term = pg_ratios.REGISTRY["dppo-tv"].term(logp, old, adv, torch.ones(1, 4, dtype=torch.float64), config, None)
    assert term.clipped.tolist() == [[True, False, True, False]]  # +0.15 > 0.1 with A > 0; -0.25 < -0.2 with A < 0
    (grad,) = torch.autograd.grad(term.per_token.sum(), logp)
    assert torch.allclose(grad, torch.tensor([[0.0, -1.1, 0.0, 0.7]], dtype=torch.float64))  # -A rho
    on_policy = pg_ratios.REGISTRY["dppo-tv"].term(logp, logp.detach(), adv, torch.ones(1, 4), config, None)
    assert not on_policy.clipped.any()
    for values, key in (({}, "objective.clip_eps"), ({"clip_eps": 0.2, "clip_ratio_c": 3.0}, "objective.clip_ratio_c")):
        with pytest.raises(ConfigError) as error:
            ObjectiveConfig(pg_ratio="dppo-tv", **values)
        assert error.value.key == key
    assert "set ratio_cap" in str(error.value)  # verl's clip_ratio_c under DPPO is klstudy's ratio_cap


def test_dppo_kls_region_is_the_binary_kl_in_the_advantages_direction_and_ratio_cap_truncates_the_weight():
    """pg_ratio dppo-kl (verl's dppo_kl): KL(Bern(p_mu) || Bern(p)) above clip_eps_high with p > p_mu and A > 0, or
    above clip_eps with p < p_mu and A <= 0, drops the token. ratio_cap truncates the detached weight: beyond it the
    gradient is -cap A grad log pi (verl's clip_ratio_c), not 0."""
    from trainer.objective import pg_ratios

    p_mu = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.02, 0.1]], dtype=torch.float64)
    p = torch.tensor([[0.75, 0.3, 0.2, 0.6, 0.2, 0.06]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    binary = p_mu * (p_mu / p).log() + (1 - p_mu) * ((1 - p_mu) / (1 - p)).log()
    # rising with A > 0, falling with A > 0, falling with A < 0, rising with A < 0, rising with A > 0, falling
    assert [round(float(b), 3) for b in binary[0]] == [0.144, 0.087, 0.223, 0.02, 0.153, 0.012]
    config = ObjectiveConfig(pg_ratio="dppo-kl", clip_eps=0.15, clip_eps_high=0.1, placement="none", ratio_cap=3.0)
    logp, old = p.log().requires_grad_(), p_mu.log()
    term = pg_ratios.REGISTRY["dppo-kl"].term(logp, old, adv, torch.ones_like(p), config, None)
    assert term.clipped.tolist() == [[True, False, True, False, True, False]]
    (grad,) = torch.autograd.grad(term.per_token.sum(), logp)
    rho = (p / p_mu).clamp(max=3.0)  # 1.5, 0.6, 0.4, 1.2, 10 -> 3, 0.6
    expected = torch.where(term.clipped, 0.0, -adv * rho)
    assert torch.allclose(grad, expected) and torch.allclose(term.per_token.detach(), expected)
    assert term.bounded.tolist() == [[False, False, False, False, True, False]]
    uncapped = ObjectiveConfig(pg_ratio="dppo-kl", clip_eps=0.2, placement="none", ratio_cap=20.0)
    wide = pg_ratios.REGISTRY["dppo-kl"].term(logp, old, adv, torch.ones_like(p), uncapped, None)
    (grad,) = torch.autograd.grad(wide.per_token[0, 4], logp)
    assert grad[0, 4] == pytest.approx(-10.0)  # inside the region at 0.2: the whole ratio p / p_mu
    on_policy = pg_ratios.REGISTRY["dppo-kl"].term(logp, logp.detach(), adv, torch.ones_like(p), config, None)
    assert not on_policy.clipped.any()
    # where p_mu or p is 1 (a log-prob of 0): 0 log 0 = 0, and a token that took all the mass is outside
    edge_logp = torch.tensor([[-0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    edge_mu = torch.tensor([[0.0, -0.5]], dtype=torch.float64)
    edge_adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    edge = pg_ratios.REGISTRY["dppo-kl"].term(edge_logp, edge_mu, edge_adv, torch.ones(1, 2), config, None)
    assert edge.clipped.tolist() == [[True, True]] and bool(torch.isfinite(edge.per_token).all())


def test_the_trust_region_and_unbiased_kl_presets_train_off_policy(warm_model, tmp_path):
    """verl's DPPO (its binary-KL region, the weight truncated at 3) and OpenRLHF's unbiased_gradient, two steps
    behind: each run trains, its mu is the trainer's recomputed pi_old (the preset's rollout key), and the ratio the
    objective reads moves off 1."""
    for preset in ("verl-dppo-kl", "openrlhf-unbiased"):
        done = train_cli(tmp_path / preset, warm_model, **{"train.steps": 4, "train.async_level": 2,
                                                           "objective.preset": preset})
        assert done.returncode == 0, done.stderr[-3000:]
        config = (tmp_path / preset / "config.yaml").read_text()
        assert "recompute_logprobs: true" in config and f"preset: {preset}" in config
        lines = read_metrics(tmp_path / preset / "metrics.jsonl")
        assert [line["step"] for line in lines] == [0, 1, 2, 3]
        assert all(math.isfinite(line["loss"]) for line in lines) and lines[3]["ratio_max"] > 1 + 1e-6
