"""Scoring hooks of klstudy's lm-eval tasks: prompts from documents, and pass@1 / pass@k.

lm-eval loads this file through `!function hooks.<name>` in the task YAMLs beside it. Every
response is scored by eval.verify, the same code that computes the trainer's rewards. With k
samples per problem (the task's `repeats`), pass@1 is the mean score over the k samples and pass@k
is 1 if any sample is right (the unbiased estimator with n = k); lm-eval averages both over
problems and reports their standard errors.
"""

from __future__ import annotations

from typing import Any, Sequence

from eval.prompts import LETTERS, arithmetic_prompt, choice_prompt, countdown_prompt, math_prompt
from eval.verify import default_verifier, last_boxed, score_choice, score_countdown


def responses(results: Sequence[Any]) -> list[str]:
    """The k responses of a problem. lm-eval hands over one entry per request; with the harness's
    take_first_k filter that entry is itself the list of the k samples."""
    flat: list[str] = []
    for item in results:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    return [str(r) for r in flat]


def pass_metrics(scores: Sequence[float]) -> dict[str, float]:
    return {"pass_at_1": sum(scores) / len(scores), "pass_at_k": float(any(s >= 1.0 for s in scores))}


def _score_against(results: Sequence[Any], gold: str) -> dict[str, float]:
    return pass_metrics(default_verifier().score_many([(r, gold) for r in responses(results)]))


# --- MATH-style: {"problem", "answer"} or {"problem", "solution" with \boxed{}} -----------------

def math_gold(doc: dict[str, Any]) -> str:
    answer = doc.get("answer")
    if answer is None:
        answer = last_boxed(str(doc.get("solution", ""))) or ""
    return str(answer)


def math_text(doc: dict[str, Any]) -> str:
    return math_prompt(str(doc["problem"]))


def math_results(doc: dict[str, Any], results: Sequence[str]) -> dict[str, float]:
    return _score_against(results, math_gold(doc))


# --- multiple choice (MMLU): {"question", "choices": [...], "answer": index or letter} ----------

def choice_gold(doc: dict[str, Any]) -> str:
    answer = doc["answer"]
    return LETTERS[int(answer)] if not isinstance(answer, str) or answer.isdigit() else answer.strip().upper()


def choice_text(doc: dict[str, Any]) -> str:
    return choice_prompt(str(doc["question"]), [str(c) for c in doc["choices"]])


def choice_results(doc: dict[str, Any], results: Sequence[str]) -> dict[str, float]:
    letters = LETTERS[:len(doc["choices"])]  # the letters this question offers, and only those
    return pass_metrics([score_choice(r, choice_gold(doc), letters) for r in responses(results)])


# --- countdown: {"nums" or "numbers": [...], "target"}, asked tersely or in words ----------------

def countdown_numbers(doc: dict[str, Any]) -> list[int]:
    return [int(n) for n in (doc["nums"] if "nums" in doc else doc["numbers"])]


def countdown_text(doc: dict[str, Any]) -> str:
    return countdown_prompt(sorted(countdown_numbers(doc)), int(doc["target"]))


def countdown_natural_text(doc: dict[str, Any]) -> str:
    return countdown_prompt(sorted(countdown_numbers(doc)), int(doc["target"]), "natural")


def countdown_results(doc: dict[str, Any], results: Sequence[str]) -> dict[str, float]:
    numbers, target = countdown_numbers(doc), int(doc["target"])
    return pass_metrics([score_countdown(r, numbers, target) for r in responses(results)])


# --- arithmetic: {"question": "12+7" or "12+7=", "answer"}, asked tersely (the toy) or in words --

def arith_expression(doc: dict[str, Any]) -> str:
    return str(doc["question"]).removesuffix("=")


def arith_text(doc: dict[str, Any]) -> str:
    return arithmetic_prompt(arith_expression(doc))


def arith_natural_text(doc: dict[str, Any]) -> str:
    return arithmetic_prompt(arith_expression(doc), "natural")


def arith_results(doc: dict[str, Any], results: Sequence[str]) -> dict[str, float]:
    return _score_against(results, str(doc["answer"]))
