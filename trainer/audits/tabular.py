"""Tabular autoregressive policies over short fixed-length sequences, with exact quantities.

A policy over sequences y = (y_1..y_T) from a vocabulary of V tokens has one row of V logits per
prefix (y_1..y_{t-1}); every distribution over sequences is reachable, so the optimum of a
regularised objective is reachable too. Everything is enumerable: the V**T sequences, the groups of
samples, and exact KLs with their gradients. `trainer.audits.enumeration` is built on this.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import torch
from torch import Tensor


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread while tabular tensors are differentiated: they are a few dozen numbers, and
    intra-op threads only contend (5 configurations' group gradients took 0.49 s on one thread and 11.7 s
    on two, on the team's loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class SequenceSpace:
    """All sequences of `length` tokens from a vocabulary of `vocab`, and their prefix rows."""

    vocab: int
    length: int

    def __post_init__(self) -> None:
        if self.vocab < 2 or self.length < 1:
            raise ValueError(f"need vocab >= 2 and length >= 1, got vocab={self.vocab}, length={self.length}")

    @property
    def n_prefixes(self) -> int:
        """Rows of the logit table: V**0 + V**1 + ... + V**(T-1)."""
        return sum(self.vocab**t for t in range(self.length))

    @property
    def n_sequences(self) -> int:
        return self.vocab**self.length

    @cached_property
    def sequences(self) -> Tensor:
        """[N, T] every sequence, in lexicographic order."""
        return torch.tensor(list(itertools.product(range(self.vocab), repeat=self.length)), dtype=torch.long)

    @cached_property
    def prefix_rows(self) -> Tensor:
        """[N, T] the logit row that token t of each sequence is drawn from.

        Rows of depth t come after all rows of smaller depth, in lexicographic order of the prefix.
        """
        rows = torch.zeros_like(self.sequences)
        offset, code = 0, torch.zeros(self.n_sequences, dtype=torch.long)
        for t in range(self.length):
            rows[:, t] = offset + code
            offset += self.vocab**t
            code = code * self.vocab + self.sequences[:, t]
        return rows

    def token_logp(self, logits: Tensor) -> Tensor:
        """[N, T] log pi(y_t | y_<t) of every token of every sequence."""
        logp_rows = torch.log_softmax(logits, dim=-1)
        return logp_rows[self.prefix_rows, self.sequences]

    def token_kl(self, logits: Tensor, ref_logits: Tensor) -> Tensor:
        """[N, T] KL(pi(.|y_<t) || pi_ref(.|y_<t)) at every position of every sequence: the exact
        next-token KL that estimator `full` puts in place of a sampled token's estimate."""
        logp, ref_logp = torch.log_softmax(logits, dim=-1), torch.log_softmax(ref_logits, dim=-1)
        return (logp.exp() * (logp - ref_logp)).sum(-1)[self.prefix_rows]

    def token_entropy(self, logits: Tensor) -> Tensor:
        """[N, T] the entropy of pi(.|y_<t) at every position of every sequence (the entropy bonus's term)."""
        logp = torch.log_softmax(logits, dim=-1)
        return -(logp.exp() * logp).sum(-1)[self.prefix_rows]

    def seq_logp(self, logits: Tensor) -> Tensor:
        """[N] log pi(y) of every sequence."""
        return self.token_logp(logits).sum(dim=-1)

    def prefix_probs(self, logits: Tensor) -> Tensor:
        """[P] probability of reaching each prefix row (the prefix distribution of the policy)."""
        probs = torch.softmax(logits, dim=-1)
        reach = [logits.new_ones(1)]
        offset = 0
        for t in range(self.length - 1):
            width = self.vocab**t
            reach.append((reach[-1].unsqueeze(-1) * probs[offset:offset + width]).reshape(-1))
            offset += width
        return torch.cat(reach)

    def groups(self, group_size: int) -> Tensor:
        """[N**G, G] every ordered group of G sequence indices."""
        return torch.tensor(list(itertools.product(range(self.n_sequences), repeat=group_size)), dtype=torch.long)

    def random_logits(self, generator: torch.Generator, scale: float = 1.0) -> Tensor:
        return scale * torch.randn(self.n_prefixes, self.vocab, generator=generator, dtype=torch.float64)


def sequence_kl(space: SequenceSpace, logits: Tensor, target_logp: Tensor) -> Tensor:
    """KL(pi || target) over whole sequences; `target_logp` is [N] log-probabilities."""
    logp = space.seq_logp(logits)
    return (logp.exp() * (logp - target_logp)).sum()


def prefix_kl(space: SequenceSpace, logits: Tensor, ref_logits: Tensor, direction: str,
              prefix_logits: Tensor | None = None) -> Tensor:
    """Sum over prefixes of sg(P_pi(prefix)) * KL at that prefix, prefix distribution held fixed (that of
    `prefix_logits` when given: a sampler's).

    direction "reverse": KL(pi(.|prefix) || pi_ref(.|prefix)) (what k2-loss optimises);
    direction "forward": KL(pi_ref(.|prefix) || pi(.|prefix)) (what k3-loss optimises).
    """
    logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    if direction == "reverse":
        per_row = (logp.exp() * (logp - ref_logp)).sum(-1)
    elif direction == "forward":
        per_row = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    else:
        raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
    reach = space.prefix_probs(logits if prefix_logits is None else prefix_logits).detach()
    return (reach * per_row).sum()


def prefix_squared_log_ratio(space: SequenceSpace, logits: Tensor, target_logits: Tensor) -> Tensor:
    """E over the target's prefixes and tokens of (log pi - log target)^2 / 2: what k2 toward the sampler,
    unweighted, differentiates (a divergence, 0 only at pi = target, but no KL)."""
    logp, target = torch.log_softmax(logits, -1), torch.log_softmax(target_logits, -1)
    per_row = (target.exp() * (logp - target) ** 2).sum(-1) / 2
    return (space.prefix_probs(target_logits).detach() * per_row).sum()


def prefix_entropy(space: SequenceSpace, logits: Tensor) -> Tensor:
    """Sum over prefixes of sg(P_pi(prefix)) * H(pi(.|prefix)), prefix distribution held fixed: what an
    entropy bonus on every token differentiates."""
    logp = torch.log_softmax(logits, -1)
    return (space.prefix_probs(logits).detach() * -(logp.exp() * logp).sum(-1)).sum()


def sequence_entropy(space: SequenceSpace, logits: Tensor) -> Tensor:
    """H(pi) over whole sequences (= E_pi[sum_t H_t] by the chain rule; its gradient also moves the prefixes)."""
    logp = space.seq_logp(logits)
    return -(logp.exp() * logp).sum()


def optimum_logp(space: SequenceSpace, ref_logits: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """[N] log pi*(y), pi* proportional to pi_ref(y) exp(R(y) / beta): argmax of E[R] - beta KL."""
    unnormalised = space.seq_logp(ref_logits) + rewards / beta
    return unnormalised - torch.logsumexp(unnormalised, dim=0)
