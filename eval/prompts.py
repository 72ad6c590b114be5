"""Prompt formats shared by training tasks and evaluation tasks, so a model is evaluated on the
very prompts it was trained on."""

from __future__ import annotations

import re
from typing import Sequence

PROMPT_STYLES = ("toy", "natural")  # the toy's terse formats; sentences with answers in \\boxed{}, for instruct models
MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = "\nThink step by step, then give the letter of the correct option within \\boxed{}."
LETTERS = "ABCDEFGHIJ"


def arithmetic_prompt(expression: str, style: str = "toy") -> str:
    """toy: `12+7=`; natural: `What is 12 + 7? Put your final answer within \\boxed{}.`"""
    if style == "toy":
        return f"{expression}="
    spaced = re.sub(r"(?<=\d)([-+*])", r" \1 ", expression)
    return f"What is {spaced}? Put your final answer within \\boxed{{}}."


def countdown_prompt(numbers: Sequence[int], target: int, style: str = "toy") -> str:
    """toy: `3 5 7 make 22:`; natural: a sentence asking for the expression within \\boxed{}."""
    if style == "toy":
        return f"{' '.join(str(n) for n in numbers)} make {target}:"
    listed = ", ".join(str(n) for n in numbers[:-1]) + f" and {numbers[-1]}"
    return (f"Using the numbers {listed}, each exactly once, and any of +, -, * and /, write an expression that "
            f"equals {target}. Put the expression within \\boxed{{}}.")


def math_prompt(problem: str) -> str:
    return problem + MATH_INSTRUCTION


def choice_prompt(question: str, choices: Sequence[str]) -> str:
    options = "\n".join(f"({LETTERS[i]}) {choice}" for i, choice in enumerate(choices))
    return f"{question}\n{options}{CHOICE_INSTRUCTION}"
