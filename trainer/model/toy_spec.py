"""The toy Llama's sizes, apart from the model code (trainer.model.models builds the model), so that
the trainer's command line, whose `toy-model` options are these fields, is built without loading
torch: `--help` and a mistyped option answer in a tenth of a second rather than over one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToyModelSpec:
    """Sizes of the toy Llama. Two heads of 32: vLLM's CPU attention has no kernel for head size 16."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 256
    seed: int = 0
    tie_embeddings: bool = True     # the output layer is the input embedding (as in Qwen3-4B, Llama-3.2)
    num_kv_heads: int = 0           # grouped-query attention's key/value heads (0: num_heads)
    vocab_size: int = 0             # > the characters' vocabulary: pad it with unused tokens, as real models are
