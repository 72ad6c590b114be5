"""Per-token log-probabilities from hidden states, chunk by chunk: never the whole [N, V] logits.

The naive computation materialises the logits of every token (N x V floats, 10 GB in float32 for
16,384 tokens and Qwen's 151,936-token vocabulary), their log-softmax, and in the backward pass
the gradient of both. Here the logits of at most `chunk` tokens exist at a time: the forward pass
keeps only each token's log-sum-exp, and the backward pass recomputes each chunk's logits from the
saved hidden states. Values and gradients are those of the naive computation (the tests check
both); the price is one extra matmul per chunk in the backward pass. Each chunk's work is a function
of its own, so that its [chunk, V] buffers are freed before the next chunk's are made: a loop's
variables would keep the last chunk's alive while the next one is computed (on an H100 that was
1,190 MiB of a 0.5B model's 6,560 MiB peak). From a chunk's logits, the log-sum-exp, the log-prob
and the entropy are taken a few rows at a time: logsumexp's own scratch and the probabilities of a
whole chunk would each be a second [chunk, V] buffer.

Under autocast (bf16 mixed precision on one process) the backward pass recomputes the logits at the
precision the forward pass computed them in (`Autocast`): autograd runs a backward outside the
autocast region, and float32 logits against a log-sum-exp of bfloat16 ones make the probability of a
confident token, and so its gradient 1 - p, a matter of rounding (docs/mixed_precision.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_CHUNK = 1024
ROWS = 64  # rows of a chunk whose log-sum-exp scratch and probabilities exist at once


def head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """One chunk's logits in the compute dtype; in place wherever possible (one [chunk, V] buffer)."""
    logits = hidden @ weight.T
    if bias is not None:
        logits += bias
    logits = logits.to(compute_dtype(hidden))
    return logits.div_(temperature) if temperature != 1.0 else logits


def compute_dtype(hidden: Tensor) -> torch.dtype:
    """float64 stays float64 (for exact tests); every lower precision is computed in float32."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Autocast:
    """The autocast state a custom Function's forward pass ran under, for its backward pass to run under
    the same: what torch.amp.custom_fwd and custom_bwd do, for the device of the inputs rather than one
    fixed where the Function is defined."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: Tensor) -> "Autocast":
        kind = tensor.device.type
        return cls(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def region(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk: int,
                temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
        logp = torch.empty(hidden.shape[0], dtype=compute_dtype(hidden), device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            _forward_chunk(hidden[rows], weight, bias, targets[rows], temperature, logp[rows], lse[rows],
                           entropy[rows] if with_entropy else None)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.temperature, ctx.autocast = chunk, temperature, Autocast.of(hidden)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        with ctx.autocast.region():
            return _ChunkedLogprobs._backward(ctx, grad_logp)

    @staticmethod
    def _backward(ctx, grad_logp: Tensor):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            _backward_chunk(hidden[rows], weight, bias, targets[rows], grad_logp[rows].to(lse.dtype), lse[rows],
                            ctx.temperature, None if grad_hidden is None else grad_hidden[rows], grad_weight,
                            grad_bias)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def _forward_chunk(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                   logp: Tensor, lse: Tensor, entropy: Tensor | None) -> None:
    """One chunk's log-probabilities and log-sum-exps (and entropies), written into the given rows, `ROWS`
    rows of its logits at a time."""
    logits = head_logits(hidden, weight, bias, temperature)
    for start in range(0, logits.shape[0], ROWS):
        rows = slice(start, start + ROWS)
        block = logits[rows]
        lse[rows] = torch.logsumexp(block, dim=-1)
        logp[rows] = block.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
        if entropy is not None:  # from the same logits: H = lse - sum(p * logits)
            probs = block.sub(lse[rows, None]).exp_()
            entropy[rows] = lse[rows] - (probs * block).sum(-1)


def _backward_chunk(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, grad_logp: Tensor,
                    lse: Tensor, temperature: float, grad_hidden: Tensor | None, grad_weight: Tensor | None,
                    grad_bias: Tensor | None) -> None:
    """One chunk's share of the gradients: written into its rows of `grad_hidden`, added to the others."""
    # d logp / d logits = onehot(target) - softmax, then through the temperature
    grad_logits = head_logits(hidden, weight, bias, temperature).sub_(lse[:, None]).exp_()
    grad_logits.mul_(-grad_logp[:, None])
    grad_logits.scatter_add_(-1, targets[:, None], grad_logp[:, None])
    grad_logits.div_(temperature)
    if grad_hidden is not None:
        grad_hidden.copy_(grad_logits.to(weight.dtype) @ weight)
    if grad_weight is not None:
        grad_weight.addmm_(grad_logits.T, hidden.to(lse.dtype))
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)


def token_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float = 1.0,
                   chunk: int = DEFAULT_CHUNK, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log softmax((hidden @ weight.T + bias) / temperature)[target] per row ([N]; float32, or float64 for
    float64 inputs), differentiable in hidden, weight and bias; and, with `with_entropy`, the entropy
    of each row's distribution (no gradient), from the same logits. At most `chunk` rows of logits
    exist at a time."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and targets [N], got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, bias, targets, chunk, temperature, with_entropy)
    return logp, entropy if with_entropy else None
