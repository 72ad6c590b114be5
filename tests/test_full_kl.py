"""Estimator full: the exact next-token KL, chunked, equals the naive [N, V] computation in values and
gradients, on raw hidden states and on a model; and its errors name their cause."""

import copy
import math

import pytest
import torch
from rounding import assert_equal_to_rounding, logprob_rounding
from run_helpers import overrides

from trainer import config as run_config
from trainer.batch import HeadInputs, Rollouts, pack
from trainer.model.logprobs import CompletionLogprobs
from trainer.objective import full_kl, kl
from trainer.objective.full_kl import token_kl, token_kl_naive
from trainer.objective.loss import ObjectiveConfig, compute_loss


def _head(n, h, v, with_bias, gen):
    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_()
    return HeadInputs(randn(n, h), randn(v, h), randn(v) if with_bias else None)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_full_kl_and_its_gradients_match_the_naive_computation(chunk, with_bias):
    gen = torch.Generator().manual_seed(0)
    policy, reference = _head(40, 8, 53, with_bias, gen), _head(40, 6, 53, with_bias, gen)  # hidden sizes may differ
    inputs = [t for head in (policy, reference) for t in (head.hidden, head.weight, head.bias) if t is not None]
    upstream = torch.randn(40, dtype=torch.float64, generator=gen)
    expected = token_kl_naive(policy, reference, temperature=0.8)
    got = token_kl(policy, reference, temperature=0.8, chunk=chunk)
    logits = [head.hidden @ head.weight.T + (0 if head.bias is None else head.bias) for head in (policy, reference)]
    size = max(float(z.abs().max()) for z in logits) / 0.8 + math.log(53)  # of the log-probs
    assert_equal_to_rounding(got, expected, 2 * size, count=8 + 53)
    assert bool((got >= 0).all())  # an exact KL
    for a, b in zip(torch.autograd.grad((got * upstream).sum(), inputs),
                    torch.autograd.grad((expected * upstream).sum(), inputs), strict=True):
        assert_equal_to_rounding(a, b, float(b.abs().max()), count=40 * 53)  # sums over rows and vocabulary


def test_a_frozen_reference_gets_no_gradient_and_costs_none():
    gen = torch.Generator().manual_seed(1)
    policy = _head(10, 4, 11, False, gen)
    reference = HeadInputs(torch.randn(10, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64), None)
    token_kl(policy, reference, chunk=3).sum().backward()
    assert policy.hidden.grad is not None and policy.weight.grad is not None
    assert reference.hidden.grad is None and reference.weight.grad is None


def test_shape_errors_name_their_cause():
    gen = torch.Generator().manual_seed(2)
    with pytest.raises(ValueError, match="vocabulary"):
        token_kl(_head(4, 3, 5, False, gen), _head(4, 3, 6, False, gen))
    with pytest.raises(ValueError, match=r"hidden states \[N, H\]"):
        token_kl(_head(4, 3, 5, False, gen), _head(3, 3, 5, False, gen))


def test_a_model_gives_the_kl_of_its_whole_next_token_distributions(model_and_perturbed_copy):
    """full_kl.logprobs_with_token_kl against the whole-vocabulary log-probs of both models, float64,
    with the same log-probs and gradients as its forward pass; padding stays 0."""
    reference_lm, policy_lm = model_and_perturbed_copy
    tokens = [[10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]
    rollouts = Rollouts(prompt_ids=[[5, 6, 7], [8, 9]], n=2, token_ids=tokens,
                        logprobs=[[0.0] * len(t) for t in tokens], texts=[""] * 4, finish_reasons=["length"] * 4)
    batch = pack(rollouts, pad_id=0)
    policy, reference = CompletionLogprobs(policy_lm, 0.9, chunk=3), CompletionLogprobs(reference_lm, 0.9, chunk=3)
    with torch.no_grad():
        states = reference.completion_states(batch)
        whole_ref, _ = reference(batch, whole_vocabulary=True)
    logp, entropy, kl = full_kl.logprobs_with_token_kl(policy, batch, states, with_entropy=True)
    whole, _ = policy(batch, whole_vocabulary=True)
    expected = (whole.exp() * (whole - whole_ref)).sum(-1) * batch.completion_mask
    assert float((kl - expected).detach().abs().max()) <= 2 * logprob_rounding(policy_lm, torch.float64)
    assert (kl == 0).sum() == (batch.completion_mask == 0).sum() and bool((kl > 0)[batch.completion_mask.bool()].all())
    forward_logp, forward_entropy = policy(batch, with_entropy=True)
    torch.testing.assert_close(logp, forward_logp, rtol=0, atol=0)
    torch.testing.assert_close(entropy, forward_entropy, rtol=0, atol=0)
    (grad_kl,) = torch.autograd.grad(kl.sum(), policy_lm.model.embed_tokens.weight)
    (grad_expected,) = torch.autograd.grad(expected.sum(), policy_lm.model.embed_tokens.weight)
    vocab, hidden = policy_lm.config.vocab_size, policy_lm.config.hidden_size
    assert_equal_to_rounding(grad_kl, grad_expected, float(grad_expected.abs().max()), count=vocab * hidden)


def test_bf16_full_kl_gradient_is_that_of_its_own_forward_pass(confident_model):
    """Under bf16 autocast the chunked KL's backward pass recomputes both models' logits in bfloat16, as its
    forward pass did: its gradient is the naive bf16 path's, to a small fraction of what bf16 rounding
    itself costs against float32. (Its backward in float32 against the bfloat16 KL it saved was the
    gradient of no computed function: 0.65 away from the naive path's on this case.)"""
    model, batch = confident_model
    reference_lm = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():  # a reference near the policy, as at the start of a run
        weight = reference_lm.lm_head.weight
        weight.add_(0.02 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(2)))
    policy, reference = CompletionLogprobs(model, chunk=128), CompletionLogprobs(reference_lm, chunk=128)
    advantages = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def output_layer_gradient(chunked: bool, bf16: bool) -> torch.Tensor:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if chunked:
                with torch.no_grad():
                    states = reference.completion_states(batch)
                kl = full_kl.logprobs_with_token_kl(policy, batch, states)[2]
            else:
                whole = policy(batch, whole_vocabulary=True)[0]
                with torch.no_grad():
                    whole_ref = reference(batch, whole_vocabulary=True)[0]
                kl = (whole.exp() * (whole - whole_ref)).sum(-1) * batch.completion_mask
        (kl * advantages).sum().backward()
        return model.lm_head.weight.grad.clone()

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    exact, naive, chunked = (output_layer_gradient(c, b) for c, b in ((False, False), (False, True), (True, True)))
    assert distance(chunked, naive) <= 0.1 * distance(naive, exact), (distance(chunked, naive), distance(naive, exact))


def test_compute_loss_with_full_needs_the_token_kl():
    logp = torch.zeros(2, 3, dtype=torch.float64)
    config = ObjectiveConfig(estimator="full", placement="loss")
    with pytest.raises(ValueError, match="estimator full: compute_loss needs token_kl"):
        compute_loss(logp, logp, None, torch.zeros(2, dtype=torch.float64), torch.ones(2, 3), 2, config)
    with pytest.raises(ValueError, match="from whole distributions"):
        kl.estimate("full", logp, logp)


def test_full_without_a_chunk_is_a_config_error(warm_model):
    with pytest.raises(run_config.ConfigError, match="train.logprob_chunk: estimator full"):
        run_config.load(None, overrides(warm_model, **{"objective.estimator": "full", "objective.placement": "loss",
                                                       "train.logprob_chunk": 0}))
