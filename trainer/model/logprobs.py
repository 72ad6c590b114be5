"""Per-token log-probabilities of sampled completions under a model, and the tensors they need.

A batch is laid out as [left-padded prompt | right-padded completion], so every completion starts
at the same column and only the completion's logits are computed (logits_to_keep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.model.chunked_logprobs import DEFAULT_CHUNK, compute_dtype, token_logprobs
from trainer.model.lean_head import LeanHead, lean_head
from trainer.objective.full_kl import HeadInputs, token_kl
from trainer.rollout.base import Rollouts


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


class CompletionLogprobs(torch.nn.Module):
    """A causal LM whose forward pass gives log pi of a packed batch's completion tokens.

    The trainer calls this module, not the LM, so that under FSDP2 one root forward owns the whole
    computation: the root gathers the embeddings and output layer that the chunked head uses
    outside the LM's own forward, and reduces their gradients afterwards."""

    def __init__(self, lm, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__()
        self.lm, self.temperature, self.chunk = lm, temperature, chunk
        self.head = lean_head(lm) if chunk else None  # checked once, while the LM is whole (before FSDP)

    def forward(self, batch: PackedBatch, with_entropy: bool = False,
                whole_vocabulary: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log pi(token) of every completion token ([B, T], float32 or the LM's wider dtype, 0 on padding)
        and, optionally, the entropy of each token's distribution (detached).

        With chunk > 0 (and an LM whose logits are a linear layer over its last hidden states, times a
        constant: `trainer.model.lean_head`), the logits of at most `chunk` tokens exist at a time
        (`trainer.model.chunked_logprobs`), and only for completion tokens; chunk = 0 computes all of them at
        once, the naive way.
        With `whole_vocabulary`, the first result is instead log pi of every vocabulary entry at every
        completion position ([B, T, V]; callers bound B x T x V), for full-distribution quantities."""
        model, temperature = self.lm, self.temperature
        length = batch.completion_ids.shape[1]
        inputs = self._inputs(batch)
        head = None if whole_vocabulary else self.head
        if head is None:
            out = model(**inputs, logits_to_keep=length + 1)
            # position P-1+t predicts completion token t
            logits = out.logits[:, :length].to(compute_dtype(out.logits)) / temperature
            logp_all = torch.log_softmax(logits, dim=-1)
            if whole_vocabulary:
                return logp_all, None
            logp = logp_all.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * batch.completion_mask
            entropy = None
            if with_entropy:
                with torch.no_grad():
                    entropy = -(logp_all.exp() * logp_all).sum(-1) * batch.completion_mask
            return logp, entropy
        return self._token_logprobs(batch, self._completion_states(batch, inputs, head), with_entropy)

    def completion_states(self, batch: PackedBatch) -> HeadInputs:
        """The last hidden states at the completion tokens' positions ([N, H], N = tokens under the mask)
        and the output layer: what whole next-token distributions are computed from (`trainer.objective.full_kl`)."""
        return self._completion_states(batch, self._inputs(batch), self._head())

    def logprobs_of(self, batch: PackedBatch, states: HeadInputs) -> torch.Tensor:
        """`forward`'s log-probs ([B, T]) from this batch's `completion_states`, without another pass."""
        return self._token_logprobs(batch, states, False)[0]

    def with_token_kl(self, batch: PackedBatch, reference: HeadInputs, with_entropy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`forward`'s log-probs and entropy, and the exact KL(pi || pi_ref) over the vocabulary at each
        completion position ([B, T], 0 on padding), from one pass of the policy; `reference` is the
        reference's `completion_states` of the same batch. Chunked: never a [B, T, V] tensor."""
        states = self._completion_states(batch, self._inputs(batch), self._head())
        logp, entropy = self._token_logprobs(batch, states, with_entropy)
        mask = batch.completion_mask.bool()
        return logp, entropy, _scatter(mask, token_kl(states, reference, self.temperature, self.chunk))

    def _inputs(self, batch: PackedBatch) -> dict:
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        return dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions,
                    use_cache=False)

    def _head(self) -> LeanHead:
        if self.head is None:
            raise ValueError("the full-vocabulary KL needs train.logprob_chunk > 0 and a model whose logits are a "
                             "linear layer over its last hidden states, times a constant (trainer.model.lean_head)")
        return self.head

    def _completion_states(self, batch: PackedBatch, inputs: dict, head: LeanHead) -> HeadInputs:
        length = batch.completion_ids.shape[1]
        hidden = self.lm.base_model(**inputs).last_hidden_state
        hidden = hidden[:, batch.prompt_width - 1:batch.prompt_width - 1 + length]  # position P-1+t predicts t
        return HeadInputs(hidden[batch.completion_mask.bool()], head.layer.weight, head.layer.bias, head.scale)

    def _token_logprobs(self, batch: PackedBatch, states: HeadInputs, with_entropy: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = batch.completion_mask.bool()
        flat, flat_entropy = token_logprobs(states.hidden, states.weight, states.bias, batch.completion_ids[mask],
                                            self.temperature / states.scale, self.chunk, with_entropy)
        logp = _scatter(mask, flat)
        return logp, None if flat_entropy is None else _scatter(mask, flat_entropy.to(logp.dtype))


def states_of_rows(states: HeadInputs, batch: PackedBatch, index: slice) -> HeadInputs:
    """The part of a batch's `completion_states` that belongs to its rows `index` (a slice with a step of 1):
    the states hold the completion tokens row after row."""
    counts = batch.completion_mask.sum(-1).long().tolist()
    start = sum(counts[: index.start or 0])
    stop = start + sum(counts[index])
    return HeadInputs(states.hidden[start:stop], states.weight, states.bias, states.scale)


def _scatter(mask: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Values of the tokens under a [B, T] mask, back to [B, T] with 0 on padding."""
    return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)


def completion_logprobs(model, batch: PackedBatch, temperature: float = 1.0, with_entropy: bool = False,
                        chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`CompletionLogprobs(model, temperature, chunk)(batch, with_entropy)`, for one-off calls."""
    return CompletionLogprobs(model, temperature, chunk)(batch, with_entropy)

