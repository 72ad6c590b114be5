"""Prompt formats shared by training tasks and evaluation tasks, so a model is evaluated on the
very prompts it was trained on."""

from __future__ import annotations

from typing import Sequence

MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = "\nThink step by step, then give the letter of the correct option within \\boxed{}."
LETTERS = "ABCDEFGHIJ"


def arithmetic_prompt(expression: str) -> str:
    return f"{expression}="


def countdown_prompt(numbers: Sequence[int], target: int) -> str:
    return f"{' '.join(str(n) for n in numbers)} make {target}:"


def math_prompt(problem: str) -> str:
    return problem + MATH_INSTRUCTION


def choice_prompt(question: str, choices: Sequence[str]) -> str:
    options = "\n".join(f"({LETTERS[i]}) {choice}" for i, choice in enumerate(choices))
    return f"{question}\n{options}{CHOICE_INSTRUCTION}"
