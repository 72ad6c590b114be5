"""The policy without dropout: every kind of dropout rate transformers models keep is set to 0, a pass
in train mode is then exactly the pass in eval mode, and a random part no rate controls is an error."""

import pytest
import torch
import transformers
from tiny_models import tiny_lm

from trainer.model.dropout import StochasticModelError, disable_dropout

IDS = torch.arange(8).unsqueeze(0)


def _logits(model, training: bool) -> torch.Tensor:
    model.train(training)
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


@pytest.mark.parametrize("config_class,rates,expected", [
    ("LlamaConfig", {"attention_dropout": 0.1}, {"attention_dropout", "config.attention_dropout"}),
    ("GPT2Config", {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}, {"Dropout", "config.attn_pdrop"}),
    ("OPTConfig", {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1, "layerdrop": 0.5},
     {"dropout", "layerdrop", "config.layerdrop"}),
    ("FalconConfig", {"attention_dropout": 0.1, "hidden_dropout": 0.1, "head_dim": None},  # read at every pass
     {"config.attention_dropout", "config.hidden_dropout"}),
    ("MixtralConfig", {"router_jitter_noise": 0.5, "num_local_experts": 2, "dtype": torch.float32},
     {"jitter_noise", "config.router_jitter_noise"}),
])
def test_every_dropout_rate_is_set_to_zero_and_train_mode_is_eval_mode(config_class, rates, expected):
    model = tiny_lm(config_class, **rates)
    assert not torch.equal(_logits(model, True), _logits(model, True))  # random before: the test is real
    changed = disable_dropout(model)
    assert model.training and expected <= set(changed), changed
    torch.testing.assert_close(_logits(model, True), _logits(model, False), rtol=0, atol=0)


class _Noisy(transformers.LlamaForCausalLM):
    """A random part of a forward pass that no dropout rate controls."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.training:
            out.logits = out.logits + torch.randn_like(out.logits)
        return out


def test_a_random_part_no_rate_controls_is_an_error_naming_the_model():
    model = _Noisy(tiny_lm("LlamaConfig").config)
    state = torch.get_rng_state()
    with pytest.raises(StochasticModelError, match="_Noisy computes different logits in two passes in train mode"):
        disable_dropout(model)
    assert torch.equal(torch.get_rng_state(), state)  # the run's random state is left as it was
