"""What every task provides: problems by index, prompts, SFT targets and rewards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from eval.prompts import PROMPT_STYLES
from eval.verify import Verifier
from trainer.model.models import encode_prompt, format_prompt


class TaskDataError(ValueError):
    """Task data that is missing, empty or malformed; the message names the config key."""


def prompt_style(style: str) -> str:
    """A synthetic task's `prompt` option, checked: one of eval.prompts.PROMPT_STYLES."""
    if style not in PROMPT_STYLES:
        raise TaskDataError(f"task.options.prompt: {style!r} is not one of {', '.join(PROMPT_STYLES)}")
    return style


@dataclass(frozen=True)
class Problem:
    """One prompt: the question text, the gold answer the verifier checks, task-specific extras."""

    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    """A finite, indexable set of problems with a reward.

    Subclasses set `name`, implement `__len__` and `problem(index)`, and may override `reward`
    and `target`. Problems are addressed by index so that a run's data position is one integer.
    """

    name = "task"
    instruction = ""  # appended to every question when it is rendered into a prompt
    style = "toy"     # how a synthetic task asks (eval.prompts.PROMPT_STYLES): natural asks for \\boxed{}

    def __len__(self) -> int:
        raise NotImplementedError

    def problem(self, index: int) -> Problem:
        raise NotImplementedError

    def prompt(self, problem: Problem, tokenizer, chat: bool) -> str:
        text = problem.question + (self.instruction if self.instruction else "")
        return format_prompt(tokenizer, text, chat)

    def prompt_ids(self, problems: Sequence[Problem], tokenizer, chat: bool) -> list[list[int]]:
        """The prompts' token ids, as every engine receives them and the trainer scores them."""
        return [encode_prompt(tokenizer, self.prompt(p, tokenizer, chat), chat) for p in problems]

    def target(self, problem: Problem) -> str:
        """The completion supervised warm-up teaches (without the EOS token)."""
        return problem.answer if self.style == "toy" else f"\\boxed{{{problem.answer}}}"

    def reward(self, responses: Sequence[str], problems: Sequence[Problem], verifier: Verifier) -> list[float]:
        return verifier.score_many([(response, p.answer) for response, p in zip(responses, problems, strict=True)])


class DataOrder:
    """Epoch-wise seeded permutations of a task's indices; the state is one integer position."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise TaskDataError("task: the data set is empty")
        self.size, self.seed = size, seed
        self._epoch, self._perm = -1, np.arange(size)

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.size)
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return int(self._perm[offset])

    def take(self, position: int, count: int) -> list[int]:
        return [self.index(position + i) for i in range(count)]
