"""The exact next-token KL over the whole vocabulary, chunk by chunk: never a [B, T, V] tensor.

At every response position t, KL_t = sum_v pi(v|y_<t) (log pi(v|y_<t) - log pi_ref(v|y_<t)), from
the policy's and the reference's last hidden states and output layers (the `full` estimator of
trainer.objective.estimators). As in `trainer.model.chunked_logprobs`, the logits of at most `chunk` positions exist
at a time, for both models: the forward pass keeps one number per position, and the backward pass
recomputes each chunk's two log-softmaxes from the saved hidden states, working in place: at most
three [chunk, V] buffers exist at a time. With z the policy's tempered
logits, p = softmax(z), q the reference's, and l = log p - log q:

    d KL_t / d z = p * (l - KL_t) / temperature,    d KL_t / d z_ref = (q - p) / temperature_ref,

each model's temperature being the sampling temperature divided by its constant logit scale
(`HeadInputs.scale`, `trainer.model.lean_head`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.batch import HeadInputs, PackedBatch, scatter
from trainer.model.chunked_logprobs import DEFAULT_CHUNK, Autocast, compute_dtype, head_logits


def _log_softmaxes(start: int, end: int, policy: tuple, reference: tuple, temperatures: tuple[float, float]
                   ) -> tuple[Tensor, Tensor]:
    """Both models' log-probabilities over the vocabulary at positions start:end."""
    logp = torch.log_softmax(head_logits(policy[0][start:end], policy[1], policy[2], temperatures[0]), dim=-1)
    ref = torch.log_softmax(head_logits(reference[0][start:end], reference[1], reference[2], temperatures[1]), dim=-1)
    return logp, ref


class _ChunkedTokenKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, chunk: int,
                temperatures: tuple[float, float]):
        policy, reference = (hidden, weight, bias), (ref_hidden, ref_weight, ref_bias)
        kl = torch.empty(hidden.shape[0], dtype=compute_dtype(hidden), device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logp, ref = _log_softmaxes(start, start + chunk, policy, reference, temperatures)
            log_ratio = ref.neg_().add_(logp)  # in place: two [chunk, V] buffers at a time
            kl[start:start + chunk] = logp.exp_().mul_(log_ratio).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl)
        ctx.chunk, ctx.temperatures, ctx.autocast = chunk, temperatures, Autocast.of(hidden)
        return kl

    @staticmethod
    def backward(ctx, grad_kl: Tensor):
        with ctx.autocast.region():  # the logits at the forward pass's precision (trainer.model.chunked_logprobs)
            return _ChunkedTokenKL._backward(ctx, grad_kl)

    @staticmethod
    def _backward(ctx, grad_kl: Tensor):
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias, kl = ctx.saved_tensors
        policy, reference = (hidden, weight, bias), (ref_hidden, ref_weight, ref_bias)
        needs = ctx.needs_input_grad
        grads = [_zeros_if(needs[i], tensor, kl.dtype) for i, tensor in enumerate(policy + reference)]
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            logp, ref = _log_softmaxes(start, end, policy, reference, ctx.temperatures)
            g = grad_kl[start:end].to(kl.dtype)[:, None]
            probs = logp.exp()
            if any(needs[3:6]):  # first: the policy's term below overwrites logp and ref in place
                grad_ref_logits = ref.exp().sub_(probs).mul_(g / ctx.temperatures[1])
                _accumulate(grads[3:6], needs[3:6], grad_ref_logits, reference, start, end)
                del grad_ref_logits
            if any(needs[:3]):
                grad_logits = logp.sub_(ref).sub_(kl[start:end, None]).mul_(probs).mul_(g / ctx.temperatures[0])
                del ref, probs
                _accumulate(grads[:3], needs[:3], grad_logits, policy, start, end)
        out = [None if grad is None else grad.to(tensor.dtype)
               for grad, tensor in zip(grads, policy + reference, strict=True)]
        return (*out, None, None)


def _zeros_if(needed: bool, tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return torch.zeros(tensor.shape, dtype=dtype, device=tensor.device) if needed and tensor is not None else None


def _accumulate(grads: list, needs: tuple, grad_logits: Tensor, inputs: tuple, start: int, end: int) -> None:
    """Add one chunk's logit gradient to its hidden states', output weight's and bias's gradients."""
    hidden, weight, _ = inputs
    if needs[0]:
        grads[0][start:end] = grad_logits.to(weight.dtype) @ weight
    if needs[1]:
        grads[1].addmm_(grad_logits.T, hidden[start:end].to(grad_logits.dtype))
    if needs[2]:  # (never for an absent bias: autograd needs no gradient of None)
        grads[2] += grad_logits.sum(0)


def token_kl(policy: HeadInputs, reference: HeadInputs, temperature: float = 1.0,
             chunk: int = DEFAULT_CHUNK) -> Tensor:
    """[N] KL(pi(.|position) || pi_ref(.|position)) at each of N positions (float32, float64 for float64
    hidden states), differentiable in both models' hidden states, weights and biases. At most `chunk`
    positions' logits exist at a time."""
    if policy.hidden.dim() != 2 or policy.hidden.shape[0] != reference.hidden.shape[0]:
        raise ValueError(f"expected hidden states [N, H] and [N, H_ref], got {tuple(policy.hidden.shape)} and "
                         f"{tuple(reference.hidden.shape)}")
    if policy.weight.shape[0] != reference.weight.shape[0]:
        raise ValueError(f"the policy's vocabulary ({policy.weight.shape[0]}) differs from the reference's "
                         f"({reference.weight.shape[0]})")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _ChunkedTokenKL.apply(policy.hidden, policy.weight, policy.bias, reference.hidden, reference.weight,
                                 reference.bias, chunk, (temperature / policy.scale, temperature / reference.scale))


def token_kl_naive(policy: HeadInputs, reference: HeadInputs, temperature: float = 1.0) -> Tensor:
    """The same from the whole [N, V] logits at once (for tests and the memory benchmark)."""
    def log_softmax(states: HeadInputs) -> Tensor:
        return torch.log_softmax(head_logits(states.hidden, states.weight, states.bias, temperature / states.scale), -1)

    logp, ref = log_softmax(policy), log_softmax(reference)
    return (logp.exp() * (logp - ref)).sum(-1)


def logprobs_with_token_kl(model, batch: PackedBatch, reference: HeadInputs, with_entropy: bool = False
                           ) -> tuple[Tensor, Tensor | None, Tensor]:
    """A CompletionLogprobs model's log-probs and entropy of a packed batch's sampled tokens (as its forward
    pass gives them), and the exact KL(pi || pi_ref) over the vocabulary at each completion position
    ([B, T], 0 on padding), from one pass of the policy; `reference` is the reference's
    `completion_states` of the same batch. Chunked: never a [B, T, V] tensor."""
    states = model.completion_states(batch)
    logp, entropy = model.logprobs_from_states(batch, states, with_entropy)
    return logp, entropy, scatter(batch.completion_mask.bool(), token_kl(states, reference, model.temperature,
                                                                        model.chunk))
