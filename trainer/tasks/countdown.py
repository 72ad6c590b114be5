"""Synthetic countdown: reach a target with each given number exactly once, using + - * /."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from eval.prompts import countdown_prompt
from eval.verify import Verifier, score_countdown
from trainer.tasks.base import Problem, Task, TaskDataError, prompt_style


class Countdown(Task):
    """Targets are built from a random expression over the numbers, so every problem is solvable; the
    prompt is in the `prompt` style (eval.prompts.PROMPT_STYLES)."""

    name = "countdown"

    def __init__(self, size: int = 100_000, count: int = 3, max_number: int = 20, seed: int = 0,
                 prompt: str = "toy") -> None:
        if size < 1 or count < 2 or max_number < 1:
            raise TaskDataError(f"task.options: countdown needs size >= 1, count >= 2, max_number >= 1; "
                                f"got size={size}, count={count}, max_number={max_number}")
        self.size, self.count, self.max_number, self.seed = size, count, max_number, seed
        self.style = prompt_style(prompt)

    def __len__(self) -> int:
        return self.size

    def problem(self, index: int) -> Problem:
        rng = np.random.default_rng([self.seed, index])
        while True:
            numbers = rng.integers(1, self.max_number + 1, size=self.count).tolist()
            expression, value = str(numbers[0]), Fraction(numbers[0])
            for x in numbers[1:]:
                op = "+-*"[int(rng.integers(0, 3))]
                value = {"+": value + x, "-": value - x, "*": value * x}[op]
                # the value is built left to right, so a product of a sum needs its brackets
                additive = any(c in expression for c in "+-")
                expression = f"({expression})*{x}" if op == "*" and additive else f"{expression}{op}{x}"
            if value.denominator == 1 and value > 0:
                break
        shown = sorted(numbers)
        question = countdown_prompt(shown, int(value), self.style)
        return Problem(question, expression, {"numbers": shown, "target": int(value)})

    def reward(self, responses, problems, verifier: Verifier) -> list[float]:
        pairs = zip(responses, problems, strict=True)
        return [score_countdown(r, p.meta["numbers"], p.meta["target"]) for r, p in pairs]
