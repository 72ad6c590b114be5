"""Which models' logits the chunked paths may compute as a linear layer over the last hidden states,
times a constant: every constant-scaled head transformers ships takes the lean path at its scale;
soft-capped heads and heads this module does not know take the naive path, found by the check
against the model's own forward pass."""

import copy

import pytest
import torch
import transformers
from tiny_models import ragged_batch, tiny_lm

from trainer.model.lean_head import lean_head
from trainer.model.logprobs import CompletionLogprobs, completion_logprobs
from trainer.objective import full_kl


@pytest.mark.parametrize("config_class,extra,scale", [
    ("LlamaConfig", {}, 1.0),
    ("GraniteConfig", {"logits_scaling": 8.0}, 1 / 8),
    ("GraniteSWAConfig", {"logits_scaling": 3.0}, 1 / 3),
    ("GraniteMoeConfig", {"logits_scaling": 8.0, "dtype": torch.float32}, 1 / 8),
    ("GraniteMoeSharedConfig", {"logits_scaling": 8.0, "dtype": torch.float32}, 1 / 8),
    ("HyperCLOVAXConfig", {"logits_scaling": 4.0}, 4.0),
    ("MiniCPM3Config", {"dim_model_base": 8}, 0.5),   # its hidden states / (hidden_size / dim_model_base)
    ("MiniCPM3Config", {"dim_model_base": 64}, 4.0),
    ("CohereConfig", {"logit_scale": 0.25}, 0.25),
    ("Cohere2Config", {"logit_scale": 0.25}, 0.25),
])
def test_constant_scaled_heads_take_the_lean_path_at_their_scale(config_class, extra, scale):
    head = lean_head(tiny_lm(config_class, **extra))
    assert head is not None and head.scale == pytest.approx(scale, rel=1e-15)


@pytest.mark.parametrize("config_class,extra", [
    ("Gemma2Config", {"final_logit_softcapping": 30.0}),  # near-linear on these small logits: found by its key
    ("RecurrentGemmaConfig", {}),
    ("VaultGemmaConfig", {}),
])
def test_soft_capped_heads_take_the_naive_path(config_class, extra):
    assert lean_head(tiny_lm(config_class, **extra)) is None


class _Tripled(transformers.LlamaForCausalLM):
    """A head transform no config key announces (as a model's own modelling code could have)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 3 * out.logits
        return out


def test_a_transform_no_key_announces_is_found_by_the_check_and_takes_the_naive_path(caplog):
    model = _Tripled(tiny_lm("LlamaConfig").config).double()
    assert model.training
    with caplog.at_level("WARNING", logger="trainer.model.lean_head"):
        assert lean_head(model) is None
    assert "_Tripled's logits are not 1 x its output layer" in caplog.text
    assert model.training  # the check ran in eval mode and gave the mode back
    batch = ragged_batch()
    lean, naive = (completion_logprobs(model, batch, chunk=chunk)[0] for chunk in (3, 0))
    torch.testing.assert_close(lean, naive, rtol=0, atol=0)  # both from the model's own logits


def test_the_full_kl_of_a_scaled_head_is_that_of_its_own_logits():
    """Granite's logits / 8 in both models' chunked log-softmaxes, values and gradients (float64)."""
    policy_lm = tiny_lm("GraniteConfig", logits_scaling=8.0)
    reference_lm = copy.deepcopy(policy_lm).requires_grad_(False)
    with torch.no_grad():
        for parameter in reference_lm.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    batch = ragged_batch()
    policy, reference = CompletionLogprobs(policy_lm, 0.9, chunk=3), CompletionLogprobs(reference_lm, 0.9, chunk=3)
    with torch.no_grad():
        states = reference.completion_states(batch)
        whole_ref, _ = reference(batch, whole_vocabulary=True)
    assert states.scale == 1 / 8
    _, _, kl = full_kl.logprobs_with_token_kl(policy, batch, states)
    whole, _ = policy(batch, whole_vocabulary=True)
    expected = (whole.exp() * (whole - whole_ref)).sum(-1) * batch.completion_mask
    assert float((kl - expected).detach().abs().max()) <= 1e-12 * float(expected.detach().abs().max())
    (grad,) = torch.autograd.grad(kl.sum(), policy_lm.lm_head.weight)
    (grad_expected,) = torch.autograd.grad(expected.sum(), policy_lm.lm_head.weight)
    assert float((grad - grad_expected).abs().max()) <= 1e-10 * float(grad_expected.abs().max())
