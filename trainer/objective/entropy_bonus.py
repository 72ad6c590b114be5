"""The exact next-token entropy with its gradient, for the entropy bonus (objective.entropy_coef).

H_t = -sum_v pi(v|y_<t) log pi(v|y_<t) = log V - KL(pi(.|y_<t) || uniform), so the chunked exact KL
of trainer.objective.full_kl gives it, values and gradients, against a "model" whose logits are all zero: its
hidden states and output layer are [N, 1] and [V, 1] zeros, so no second [V, H] layer is ever built
and, as for the KL, no [B, T, V] tensor exists. Its gradient is the pathwise one, with the prefix
distribution held fixed, as the libraries differentiate their entropy bonus (docs/peers.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.batch import HeadInputs
from trainer.model.chunked_logprobs import compute_dtype
from trainer.objective.full_kl import token_kl


def uniform(states: HeadInputs) -> HeadInputs:
    """Zero logits at each of `states`' positions: the uniform distribution over their vocabulary."""
    dtype = compute_dtype(states.hidden)
    return HeadInputs(torch.zeros((states.hidden.shape[0], 1), dtype=dtype, device=states.hidden.device),
                      torch.zeros((states.weight.shape[0], 1), dtype=dtype, device=states.weight.device), None)


def token_entropy(states: HeadInputs, temperature: float, chunk: int) -> Tensor:
    """[N] the entropy of the tempered next-token distribution at each position, differentiable."""
    return math.log(states.weight.shape[0]) - token_kl(states, uniform(states), temperature, chunk)


def logprobs_with_entropy(model, batch, reference: HeadInputs | None = None
                          ) -> tuple[Tensor, Tensor | None, Tensor]:
    """A CompletionLogprobs model's log-probs of a packed batch's sampled tokens, its exact KL to the
    `reference` at each position (given the reference's completion states; else None) and each
    position's entropy with its gradient: [B, T] each, 0 on padding, from one pass of the policy."""
    states = model.completion_states(batch)
    mask = batch.completion_mask.bool()

    def scatter(flat: Tensor) -> Tensor:
        return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)

    logp = model.logprobs_from_states(batch, states)[0]
    entropy = scatter(token_entropy(states, model.temperature, model.chunk))
    kl = None if reference is None else scatter(token_kl(states, reference, model.temperature, model.chunk))
    return logp, kl, entropy
