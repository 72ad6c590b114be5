"""The rollout-engine interface: n samples per prompt, with behaviour log-probs and finish reasons."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from trainer.batch import Rollouts

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `n` completions per prompt; `stop` strings end a completion (not in its text)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"rollout: n and max_new_tokens must be >= 1, got {self.n} and {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature: must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p: must be in (0, 1], got {self.top_p}")


def check_seeds(prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int]) -> None:
    """One seed per prompt, as `RolloutEngine.generate` requires."""
    if len(seeds) != len(prompt_ids):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompt_ids)} prompts")


def sample_seeds(seed: int, start: int, count: int) -> list[int]:
    """One sampling seed per prompt slot start..start+count-1 of a run seeded with `seed`.

    A prompt's completions depend only on its own seed, so a batch split across processes (or
    resumed from a checkpoint) samples exactly what one process would have sampled."""
    return [int(np.random.SeedSequence([seed, slot]).generate_state(1)[0]) for slot in range(start, start + count)]


class RolloutEngine(Protocol):
    """What the trainer needs from a generation backend."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: Sequence[int]) -> Rollouts:
        """`params.n` completions of every prompt, grouped in consecutive rows; prompt i's completions
        are drawn from a generator seeded with seeds[i] alone (whatever else is in the batch)."""
        ...

    def sync_weights(self) -> None:
        """Make the next generate() use the trainer's current weights."""
        ...

    def close(self) -> None:
        """Release what the engine holds (processes, process groups, memory); it is not used again."""
        ...
