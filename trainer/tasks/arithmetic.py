"""Synthetic arithmetic: "a+b=" -> "c", seeded per index, difficulty set by operand size and ops; the
prompt terse (the toy's) or a sentence asking for the answer in \\boxed{} (for instruct models)."""

from __future__ import annotations

import numpy as np

from eval.prompts import arithmetic_prompt
from trainer.tasks.base import Problem, Task, TaskDataError, prompt_style


class Arithmetic(Task):
    """`size` problems of `terms` operands in [0, max_operand] joined by operators from `ops`, asked in the
    `prompt` style (eval.prompts.PROMPT_STYLES)."""

    name = "arithmetic"

    def __init__(self, size: int = 100_000, max_operand: int = 20, ops: str = "+-", terms: int = 2,
                 seed: int = 0, prompt: str = "toy") -> None:
        if size < 1 or max_operand < 1 or terms < 2 or not ops or set(ops) - set("+-*"):
            raise TaskDataError(
                f"task.options: arithmetic needs size >= 1, max_operand >= 1, terms >= 2 and ops from "
                f"'+-*'; got size={size}, max_operand={max_operand}, terms={terms}, ops={ops!r}")
        self.size, self.max_operand, self.ops, self.terms, self.seed = size, max_operand, ops, terms, seed
        self.style = prompt_style(prompt)

    def __len__(self) -> int:
        return self.size

    def problem(self, index: int) -> Problem:
        rng = np.random.default_rng([self.seed, index])
        operands = rng.integers(0, self.max_operand + 1, size=self.terms).tolist()
        operators = [self.ops[i] for i in rng.integers(0, len(self.ops), size=self.terms - 1)]
        expression = str(operands[0]) + "".join(op + str(x) for op, x in zip(operators, operands[1:], strict=True))
        value = int(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and + - * only, built here
        return Problem(question=arithmetic_prompt(expression, self.style), answer=str(value),
                       meta={"expression": expression})
