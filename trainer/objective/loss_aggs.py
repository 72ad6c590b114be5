"""How per-token losses become one number (objective.loss_agg, objective.kl_loss_agg): one registered
function each, whose docstring is its theory note.

Every function takes `(masked, mask, rows, tokens, norm_length)`: the per-token losses [B, T] already
multiplied by the response mask, the mask, and the (rows, tokens) of the whole batch these rows are a
part of, so that the parts' losses (micro-batches, processes) add up to the whole batch's exactly
(`trainer.objective.loss.aggregate`). One registered with `needs_prompt_lengths` also takes
`prompt_lengths`, [B] the tokens of each row's prompt. Tensor methods only: configs validate without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from trainer.objective.registry import Registry, theory_note

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class LossAgg:
    name: str
    reduce: Callable[..., Tensor]  # (masked [B, T], mask [B, T], rows, tokens, norm_length) -> scalar
    needs_norm_length: bool = False  # reads objective.norm_length
    needs_prompt_lengths: bool = False  # reads each row's prompt length (the keyword prompt_lengths, [B])
    sums_tokens: bool = False  # its gradient is the token sums' itself, under which the theory is exact (else,
                               # with responses of one length, a constant times it: the audit's verdict "scaled")

    @property
    def theory(self) -> str:
        return theory_note(self.reduce)


REGISTRY: Registry[LossAgg] = Registry("loss aggregation")


register = REGISTRY.decorator(LossAgg)  # @register(name, **options) over the function


@register("seq-mean-token-sum", sums_tokens=True)
def seq_mean_token_sum(masked: Tensor, mask: Tensor, rows: Any, tokens: Any, norm_length: int | None) -> Tensor:
    """The mean over responses of their token sums: the aggregation under which the KL identities
    (docs/concepts/theory.md, "When the identities are exact") are exact."""
    return masked.sum(dim=-1).sum() / rows


@register("seq-mean-token-mean")
def seq_mean_token_mean(masked: Tensor, mask: Tensor, rows: Any, tokens: Any, norm_length: int | None) -> Tensor:
    """The mean over responses of their token means: each response weighs the same whatever its length."""
    return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum() / rows


@register("token-mean")
def token_mean(masked: Tensor, mask: Tensor, rows: Any, tokens: Any, norm_length: int | None) -> Tensor:
    """The mean over every response token of the batch: long responses weigh more."""
    return masked.sum() / tokens


@register("seq-mean-token-sum-norm", needs_norm_length=True)
def seq_mean_token_sum_norm(masked: Tensor, mask: Tensor, rows: Any, tokens: Any, norm_length: int | None) -> Tensor:
    """Token sums divided by the fixed `norm_length` (Dr. GRPO), then the mean over responses: the
    token sums' gradient, scaled by a constant."""
    if norm_length is None:
        raise ValueError("seq-mean-token-sum-norm needs norm_length")
    return masked.sum(dim=-1).sum() / rows / norm_length


@register("seq-mean-token-sum-seq-len", needs_prompt_lengths=True)
def seq_mean_token_sum_seq_len(masked: Tensor, mask: Tensor, rows: Any, tokens: Any, norm_length: int | None,
                               prompt_lengths: Tensor) -> Tensor:
    """Each response's token sum divided by its whole sequence's length, prompt and response tokens, then the
    mean over responses: the Comedy paper's prime-rl fork (normalize_batch_to_token_count with one sequence per
    micro-batch). A response of L tokens after a prompt of P weighs L / (P + L) of what seq-mean-token-mean
    gives it: between the token means (P = 0) and the token sums' gradient scaled by 1 / (P + L) (a prompt much
    longer than its responses). With prompts and responses of one length each, the token sums' gradient times
    1 / (P + L)."""
    return (masked.sum(dim=-1) / (prompt_lengths.to(masked.dtype) + mask.sum(dim=-1)).clamp(min=1)).sum() / rows
