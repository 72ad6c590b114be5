"""Tiny randomly initialised transformers models of any architecture, for tests of what the trainer
assumes about a model's forward pass (its output layer, its train mode)."""

import torch
import transformers

SIZES = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)


def tiny_lm(config_class: str, seed: int = 0, dtype: torch.dtype = torch.float64, **extra):
    """A causal LM of `config_class` (a transformers config class name) with SIZES and `extra` keys (an
    extra key set to None leaves that key to the config's default)."""
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{k: v for k, v in {**SIZES, **extra}.items() if v is not None})
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def ragged_batch():
    """Two prompts x two completions of 4, 1, 2 and 3 tokens, packed (pad id 0): token ids below 20."""
    from trainer.batch import Rollouts, pack

    tokens = [[10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]
    rollouts = Rollouts(prompt_ids=[[5, 6, 7], [8, 9]], n=2, token_ids=tokens,
                        logprobs=[[0.0] * len(t) for t in tokens], texts=[""] * 4, finish_reasons=["length"] * 4)
    return pack(rollouts, pad_id=0)
