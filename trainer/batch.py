"""The batch types every layer passes around: the engine's rollouts, the packed tensors the models read, the
hidden states whole next-token distributions are computed from. A bottom module: it imports torch alone, so
that the models, the objective and the engines meet here instead of importing one another."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Rollouts:
    """Completions of prompts, `n` per prompt in consecutive rows.

    token_ids        sampled tokens of each completion (EOS included when it ended on EOS; a
                     completion cut by a stop string keeps every sampled token)
    logprobs         behaviour log-probability of each sampled token, under the distribution it was
                     actually sampled from (temperature and top-p applied)
    texts            decoded completions, special tokens dropped, cut before the first stop string
    finish_reasons   "stop" (EOS or a stop string) or "length" (max_new_tokens reached)
    """

    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    texts: list[str]
    finish_reasons: list[str]
    n: int

    def __len__(self) -> int:
        return len(self.token_ids)

    def to_state(self) -> dict:
        """A plain dict (for checkpoints)."""
        return dict(self.__dict__)

    @classmethod
    def from_state(cls, state: dict) -> "Rollouts":
        return cls(**state)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor        # [B, P + T]
    attention_mask: torch.Tensor   # [B, P + T]
    completion_ids: torch.Tensor   # [B, T]
    completion_mask: torch.Tensor  # [B, T] float, 1 on sampled tokens
    behaviour_logp: torch.Tensor   # [B, T] the engine's log-probs (0 on padding)
    prompt_width: int

    def to(self, device: torch.device) -> "PackedBatch":
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return PackedBatch(**moved)

    def rows(self, index: slice) -> "PackedBatch":
        sliced = {k: v[index] if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return PackedBatch(**sliced)

    @property
    def tokens(self) -> int:
        """Non-padding tokens: what a forward pass over the batch processes."""
        return int(self.attention_mask.sum())

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """[B] the tokens of each row's prompt (left-padded to prompt_width)."""
        return self.attention_mask[:, :self.prompt_width].sum(dim=-1)


def pack(rollouts: Rollouts, pad_id: int) -> PackedBatch:
    """Tensors of prompts (repeated n times) and completions; empty completions get one masked pad."""
    prompts = [p for p in rollouts.prompt_ids for _ in range(rollouts.n)]
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    length = max(1, max(len(t) for t in rollouts.token_ids))
    input_ids = torch.full((batch, width + length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width + length), dtype=torch.long)
    completion_mask = torch.zeros((batch, length))
    for i, (prompt, tokens) in enumerate(zip(prompts, rollouts.token_ids, strict=True)):
        input_ids[i, width - len(prompt):width] = torch.tensor(prompt)
        attention[i, width - len(prompt):width + len(tokens)] = 1
        if tokens:
            input_ids[i, width:width + len(tokens)] = torch.tensor(tokens)
            completion_mask[i, :len(tokens)] = 1
    behaviour = token_matrix(rollouts.logprobs, length)
    return PackedBatch(input_ids, attention, input_ids[:, width:].clone(), completion_mask, behaviour, width)


def token_matrix(rows: list[list[float]], length: int) -> torch.Tensor:
    """Per-token values of completions (ragged rows) as a [B, length] float tensor, 0 after each row."""
    out = torch.zeros((len(rows), length))
    for i, row in enumerate(rows):
        if row:
            out[i, :len(row)] = torch.tensor(row)
    return out


@dataclass
class HeadInputs:
    """What one model's next-token distributions at N positions are computed from:
    log_softmax(scale * (hidden @ weight.T + bias) / temperature)."""

    hidden: Tensor        # [N, H]
    weight: Tensor        # [V, H]
    bias: Tensor | None   # [V]
    scale: float = 1.0    # the constant the model multiplies its output layer's logits by


def completion_counts(batch: PackedBatch) -> list[int]:
    """Each row's completion tokens, on the host: where its `completion_states` lie (states_of_rows)."""
    return batch.completion_mask.sum(-1).long().tolist()


def states_of_rows(states: HeadInputs, counts: list[int], index: slice) -> HeadInputs:
    """The part of a batch's `completion_states` that belongs to its rows `index` (a slice with a step of 1):
    the states hold the completion tokens row after row, `counts` of them each (completion_counts)."""
    start = sum(counts[: index.start or 0])
    stop = start + sum(counts[index])
    return HeadInputs(states.hidden[start:stop], states.weight, states.bias, states.scale)


def scatter(mask: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Values of the tokens under a [B, T] mask, back to [B, T] with 0 on padding."""
    return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)
