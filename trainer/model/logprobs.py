"""Per-token log-probabilities of sampled completions under a model (its batches: `trainer.batch`).

A batch is laid out as [left-padded prompt | right-padded completion], so every completion starts
at the same column and only the completion's logits are computed (logits_to_keep).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from trainer.batch import HeadInputs, PackedBatch, scatter
from trainer.model.chunked_logprobs import DEFAULT_CHUNK, compute_dtype, token_logprobs
from trainer.model.lean_head import LeanHead, lean_head

Result = TypeVar("Result")


class CompletionLogprobs(torch.nn.Module):
    """A causal LM whose forward pass gives log pi of a packed batch's completion tokens.

    The trainer calls this module, not the LM, so that under FSDP2 one root forward owns the whole
    computation: the root gathers the embeddings and output layer that the chunked head uses
    outside the LM's own forward, and reduces their gradients afterwards."""

    def __init__(self, lm, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__()
        self.lm, self.temperature, self.chunk = lm, temperature, chunk
        self.head = lean_head(lm) if chunk else None  # checked once, while the LM is whole (before FSDP)

    def forward(self, batch: PackedBatch | None = None, with_entropy: bool = False, whole_vocabulary: bool = False,
                within: Callable[[], Result] | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | Result:
        """log pi(token) of every completion token ([B, T], float32 or the LM's wider dtype, 0 on padding)
        and, optionally, the entropy of each token's distribution (detached). With `within`, its result
        instead (`in_forward`).

        With chunk > 0 (and an LM whose logits are a linear layer over its last hidden states, times a
        constant: `trainer.model.lean_head`), the logits of at most `chunk` tokens exist at a time
        (`trainer.model.chunked_logprobs`), and only for completion tokens; chunk = 0 computes all of them at
        once, the naive way.
        With `whole_vocabulary`, the first result is instead log pi of every vocabulary entry at every
        completion position ([B, T, V]; callers bound B x T x V), for full-distribution quantities."""
        if within is not None:
            return within()
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
        return self.logprobs_from_states(batch, self._completion_states(batch, inputs, head), with_entropy)

    def in_forward(self, compute: Callable[[], Result]) -> Result:
        """compute()'s result, computed inside this module's forward pass. Under FSDP2 the root's parameters (the
        embeddings and the output layer that `completion_states` hands out) are whole, and their gradients reduced
        over processes, only for what a forward pass computes: the exact KL and entropy, which read the output layer
        outside the LM's own forward, are computed through here."""
        return self(within=compute)

    def completion_states(self, batch: PackedBatch, keep: bool = False) -> HeadInputs:
        """The last hidden states at the completion tokens' positions ([N, H], N = tokens under the mask)
        and the output layer: what whole next-token distributions are computed from (`trainer.objective.full_kl`).
        Call it `in_forward`; with `keep`, the output layer is a detached copy, which nothing FSDP2 frees after the
        forward pass can touch (the reference's, kept for the step)."""
        states = self._completion_states(batch, self._inputs(batch), self._head())
        if not keep:
            return states
        bias = None if states.bias is None else states.bias.detach().clone()
        return HeadInputs(states.hidden.detach(), states.weight.detach().clone(), bias, states.scale)

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

    def logprobs_from_states(self, batch: PackedBatch, states: HeadInputs, with_entropy: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`'s log-probs and entropy from this batch's `completion_states`, without another pass."""
        mask = batch.completion_mask.bool()
        flat, flat_entropy = token_logprobs(states.hidden, states.weight, states.bias, batch.completion_ids[mask],
                                            self.temperature / states.scale, self.chunk, with_entropy)
        logp = scatter(mask, flat)
        return logp, None if flat_entropy is None else scatter(mask, flat_entropy.to(logp.dtype))


def completion_logprobs(model, batch: PackedBatch, temperature: float = 1.0, with_entropy: bool = False,
                        chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`CompletionLogprobs(model, temperature, chunk)(batch, with_entropy)`, for one-off calls."""
    return CompletionLogprobs(model, temperature, chunk)(batch, with_entropy)

