"""Exact enumeration on random tabular policies: the expected gradient of `compute_loss` itself.

Every ordered group of samples (or batch of groups) is enumerated and weighted by its probability under
the sampler, so the expectation of the sampled gradient, and its variance, are exact. The audits
(`trainer.audits.audit`, the peers' and the presets') and the identity tests are built on this, with
the exact gradients of the KLs a configuration may be differentiating (`target_gradients`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.audits import tabular
from trainer.audits.tabular import one_thread
from trainer.objective.loss import ObjectiveConfig, compute_loss

# The tokens of the prompt that every tabular sequence follows (its content never matters: the policy's first row
# is its context). Only an aggregation that divides by the whole sequence's length reads it.
PROMPT_LENGTH = 3


@dataclass(frozen=True)
class AuditInstance:
    """One random tabular problem: reference, policy, behaviour policy and rewards (float64)."""

    space: tabular.SequenceSpace
    ref_logits: Tensor
    logits: Tensor
    behaviour_logits: Tensor
    rewards: Tensor

    @classmethod
    def random(cls, vocab: int, length: int, seed: int, policy_shift: float = 0.7,
               behaviour_shift: float = 0.5) -> "AuditInstance":
        """pi_ref random; pi and mu random perturbations of pi_ref and pi; rewards in [0.1, 1]."""
        space = tabular.SequenceSpace(vocab, length)
        gen = torch.Generator().manual_seed(seed)
        ref = space.random_logits(gen)
        pi = ref + space.random_logits(gen, policy_shift)
        mu = pi + space.random_logits(gen, behaviour_shift)
        rewards = 0.1 + 0.9 * torch.rand(space.n_sequences, generator=gen, dtype=torch.float64)
        return cls(space, ref, pi, mu, rewards)


def _enumerated(inst: AuditInstance, config: ObjectiveConfig, group_size: int, off_policy: bool,
                groups: Tensor | None, engine_mismatch: bool, batch_groups: int = 1):
    """(every ordered batch of `batch_groups` groups, each batch's probability under its sampler, and
    `group_loss`: group_loss(theta)(rows) is compute_loss on those rows of the policy with logits theta)."""
    space = inst.space
    groups = space.groups(group_size * batch_groups) if groups is None else groups
    ref_logp = space.token_logp(inst.ref_logits)
    sampler_logits = inst.behaviour_logits if off_policy or engine_mismatch else inst.logits
    sampler_token_logp = space.token_logp(sampler_logits)
    weights = sampler_token_logp.sum(-1)[groups].sum(-1).exp()
    if not bool((weights > 0).all()):  # a sampler that never draws some sequences (top-p): only those it draws
        groups, weights = groups[weights > 0], weights[weights > 0]
    mask = torch.ones(groups.shape[1], space.length, dtype=torch.float64)
    prompt_lengths = torch.full((groups.shape[1],), float(PROMPT_LENGTH), dtype=torch.float64)
    full = config.needs_full_kl
    sampler_token_kl = space.token_kl(sampler_logits, inst.ref_logits) if full and off_policy else None
    engine = engine_mismatch or config.needs_engine_logp  # the sampler is the engine (exact unless mismatched)

    def group_loss(theta: Tensor):
        logp = space.token_logp(theta)
        token_kl = space.token_kl(theta, inst.ref_logits) if full else None
        entropy = space.token_entropy(theta) if config.entropy_coef else None

        def loss(rows: Tensor) -> Tensor:
            return compute_loss(logp[rows], ref_logp[rows], sampler_token_logp[rows] if off_policy else None,
                                inst.rewards[rows], mask, group_size, config,
                                engine_logp=sampler_token_logp[rows] if engine else None,
                                token_kl=None if token_kl is None else token_kl[rows],
                                old_token_kl=None if sampler_token_kl is None else sampler_token_kl[rows],
                                entropy=None if entropy is None else entropy[rows], stats=False,
                                prompt_lengths=prompt_lengths)[0]
        return loss

    return groups, weights, group_loss


def expected_gradient(inst: AuditInstance, config: ObjectiveConfig, group_size: int,
                      off_policy: bool, groups: Tensor | None = None, engine_mismatch: bool = False,
                      batch_groups: int = 1) -> Tensor:
    """E over groups sampled from pi (or mu when off_policy) of grad_theta compute_loss.

    engine_mismatch: the groups come from mu, an inexact rollout engine, while the trainer takes
    them for on-policy (old_logp None) and is given mu's log-probs as the engine's (`engine_logp`,
    which objective.tis_cap corrects with). batch_groups: each loss is of a batch of that many groups
    (of one prompt), as an advantage that reads the whole batch (whitening) sees them.

    Exact: every ordered group of `group_size` sequences (batch of groups) is enumerated and weighted by
    its probability; sampling itself is not differentiated, as in training.
    """
    with one_thread():
        groups, weights, group_loss = _enumerated(inst, config, group_size, off_policy, groups, engine_mismatch,
                                                  batch_groups)
        theta = inst.logits.clone().requires_grad_(True)
        loss = group_loss(theta)
        try:  # every group's loss in one vectorized call, as in group_gradients
            losses = torch.func.vmap(loss)(groups)
        except Exception:  # noqa: BLE001 - not vectorizable: the loss's own errors are raised again below
            losses = torch.stack([loss(rows) for rows in groups])
        (grad,) = torch.autograd.grad(weights @ losses, theta)
    return grad


def group_gradients(inst: AuditInstance, config: ObjectiveConfig, group_size: int, off_policy: bool,
                    groups: Tensor | None = None, engine_mismatch: bool = False) -> tuple[Tensor, Tensor]:
    """The gradient of compute_loss on each ordered group, [groups, *theta], and each group's
    probability: the exact distribution of the sampled gradient of one group (`engine_mismatch` as in
    `expected_gradient`).

    All groups' gradients are taken in one vectorized call (torch.func: the same gradients, in a tenth of
    the time of a backward pass per group); a loss that torch.func cannot vectorize (one that branches on
    its values, say) is differentiated group by group instead."""
    with one_thread():
        groups, weights, group_loss = _enumerated(inst, config, group_size, off_policy, groups, engine_mismatch)
        theta = inst.logits.clone()
        try:
            grads = torch.func.vmap(torch.func.grad(lambda th, rows: group_loss(th)(rows)), in_dims=(None, 0))(
                theta, groups)
        except Exception:  # noqa: BLE001 - not vectorizable: the loss's own errors are raised again below
            theta.requires_grad_(True)
            loss = group_loss(theta)
            grads = torch.stack([torch.autograd.grad(loss(rows), theta, retain_graph=True)[0] for rows in groups])
    return grads, weights


def expectation(grads: Tensor, weights: Tensor) -> Tensor:
    """The mean of a discrete distribution of gradients [groups, *theta], shaped as one gradient."""
    return (weights @ grads.flatten(1)).view_as(grads[0])


def variance(grads: Tensor, weights: Tensor) -> float:
    """Trace of the covariance of a discrete distribution of gradients: E||g||^2 - ||E g||^2."""
    flat = grads.flatten(1)
    mean = weights @ flat
    return float(weights @ (flat * flat).sum(-1) - mean @ mean)


def target_gradients(inst: AuditInstance) -> dict[str, Tensor]:
    """Exact gradients of the candidate targets at pi, keyed by verdict label, plus E[R]'s."""
    space = inst.space

    def grad_of(fn) -> Tensor:
        theta = inst.logits.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(theta), theta)
        return g

    ref_seq_logp = space.seq_logp(inst.ref_logits)
    return {
        "unbiased": grad_of(lambda th: tabular.sequence_kl(space, th, ref_seq_logp)),
        "per-prefix reverse": grad_of(lambda th: tabular.prefix_kl(space, th, inst.ref_logits, "reverse")),
        "per-prefix forward": grad_of(lambda th: tabular.prefix_kl(space, th, inst.ref_logits, "forward")),
        "reward": grad_of(lambda th: (space.seq_logp(th).exp() * inst.rewards).sum()),
    }


def cosine(a: Tensor, b: Tensor) -> float:
    denom = a.norm() * b.norm()
    return float((a.flatten() @ b.flatten()) / denom) if denom > 0 else float("nan")


def rel_error(a: Tensor, target: Tensor) -> float:
    return float((a - target).norm() / target.norm())
