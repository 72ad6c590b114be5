"""Answer extraction and verification: the one scorer of training rewards and evaluation.

`score(response, gold)` returns 1.0 when the response's final answer equals `gold` and 0.0
otherwise, and never raises; `score_choice` scores multiple-choice letters, for a task that knows
its choices. Cheap cases (numbers, identical strings) are decided here;
anything else goes to math-verify in a DeadlinePool, so that no input, however hostile, can cost
more than the verifier's timeout or crash the caller. `Verifier.counts` says how many calls timed
out, failed, or were rejected before verification (over-long responses or answers).
"""

from __future__ import annotations

import ast
import atexit
import functools
import logging
import re
import threading
import time
from collections import Counter
from fractions import Fraction
from typing import Iterable, Sequence

from eval.prompts import LETTERS
from eval.workers import DeadlinePool, Outcome, WorkerStartError

log = logging.getLogger(__name__)

MAX_RESPONSE_CHARS = 65_536   # longer responses are rejected unread (score 0)
MAX_ANSWER_CHARS = 512        # longer extracted answers are rejected (score 0)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_FRAC = re.compile(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def as_text(response: str | bytes) -> str:
    """Responses arrive as str; bytes (possibly invalid UTF-8) are decoded with replacement."""
    if isinstance(response, bytes):
        return response.decode("utf-8", errors="replace")
    return str(response)


def last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} (or \\fbox{...}), braces balanced; None if none."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, min(len(text), start + MAX_ANSWER_CHARS + 1)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def answer_phrase(text: str) -> str | None:
    """What follows the last "the answer is" / "final answer:" on its line."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    answer = matches[-1].group(1).strip().rstrip(".").strip().strip("$").strip().rstrip(".").strip()
    return answer or None


def last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: \\boxed{}, else "the answer is ...", else the last number.

    A response that writes \\boxed is judged by its last complete \\boxed{} alone: an unclosed one
    is no answer, not an invitation to fall back on stray numbers.
    """
    if _BOXED.search(text):
        return last_boxed(text)
    for extractor in (answer_phrase, last_number):
        answer = extractor(text)
        if answer:
            return answer
    return None


@functools.lru_cache(maxsize=16)
def _choice_patterns(letters: str) -> tuple[list[re.Pattern], list[re.Pattern]]:
    """(explicit, implicit) patterns of a choice among `letters`; each captures the letter once."""
    upper = re.escape(letters.upper())
    either = upper + re.escape(letters.lower())
    answer = r"\b(?i:answer)s?\b"
    chosen = r"\b(?i:(?:option|choice)\s*(?:is|:))"  # "the correct option is", not "option C is wrong"
    # "(b)", "**B**", or a bare letter that ends a clause ("Answer: B.")
    shaped = rf"(?:\(\s*([{either}])\s*\)|\*\*\(?([{either}])\)?\*\*|(?<![\w\\])([{either}])(?=\s*(?:[.,;:!?*)]|$)))"
    # a bare letter that does not read as a word ("I think", "a bit")
    bare = rf"(?![IiAa]\s+[a-z])([{either}])(?![\w])"
    explicit = [rf"\\boxed\s*\{{\s*\(?\s*(?:\\text(?:bf)?\{{\s*)?([{either}])\s*\}}?\s*\)?\s*\}}",
                answer + r"(?i:\s+(?:is|would\s+be|must\s+be|should\s+be))?\s*:?\s*(?i:(?:option|choice)\s+)?" + bare,
                rf"{answer}[^\n]{{0,40}}?{shaped}",
                rf"{chosen}\s*{bare}",
                rf"{chosen}\s*{shaped}"]
    implicit = [rf"\(\s*([{upper}])\s*\)", rf"\*\*\(?([{upper}])\)?\*\*",
                rf"^\s*(?:\*\*)?\(?([{upper}])\)?(?:\*\*)?\s*[.:]?\s*$"]
    return ([re.compile(p, re.MULTILINE) for p in explicit], [re.compile(p, re.MULTILINE) for p in implicit])


def choice_letter(text: str, letters: str = LETTERS) -> str | None:
    """The multiple-choice letter (one of `letters`, the task's own) a response settles on.

    A letter counts only as a whole word that is evidently a choice. Explicit choices are a letter
    in \\boxed{}, or one that follows "answer" on its line (right after "answer is" / "answer:", not
    "answer: I think", or shaped as "(b)", "**B**" or a letter that ends a clause), or "option is" /
    "choice:"; there lowercase counts too. Otherwise an uppercase "(B)" or "**B**", or a line
    that is just a letter. The last explicit choice wins (self-corrections), else the last other."""
    for patterns in _choice_patterns(letters):
        found = [(m.end(), next(g for g in m.groups() if g)) for p in patterns for m in p.finditer(text)]
        if found:
            return max(found)[1].upper()
    return None


def _strip(s: str) -> str:
    s = s.strip().strip("$").strip()
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "\\displaystyle"):
        s = s.replace(token, "")
    return re.sub(r"\s+", "", s).rstrip(".")


def as_number(s: str) -> Fraction | None:
    """An exact number for plain integers, decimals, 1,000-style integers, a/b and \\frac{a}{b}."""
    s = _strip(s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if len(s) > 64:
        return None
    if _PLAIN_NUMBER.fullmatch(s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    m = _FRAC.fullmatch(s)
    if m and int(m.group(3)) != 0:
        return (-1 if m.group(1) else 1) * Fraction(int(m.group(2)), int(m.group(3)))
    return None


def math_equivalent(candidate: str, gold: str) -> bool:
    """math-verify's verdict, with its own timeouts off (the caller bounds the time)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    candidate_parsed = parse(f"${candidate}$", parsing_timeout=None)
    if not gold_parsed or not candidate_parsed:
        return False
    return bool(verify(gold_parsed, candidate_parsed, timeout_seconds=None))


class VerifierUnavailable(RuntimeError):
    """The verifier's worker processes failed to start too many times in a row."""


class Verifier:
    """Scores responses against gold answers; every math-verify call is bounded by `timeout` s.

    Its worker processes can fail to start (a loaded node: sympy's imports alone take seconds). Then
    the responses that needed them count as verifier errors (score 0), the next start waits
    `start_backoff` s, doubling with each failure in a row, and `max_start_failures` failures in a
    row raise VerifierUnavailable."""

    TARGET = "eval.verify:math_equivalent"

    def __init__(self, timeout: float = 5.0, workers: int = 2, start_backoff: float = 5.0,
                 max_start_failures: int = 3) -> None:
        self.timeout = timeout
        self.workers = workers
        self.start_backoff = start_backoff
        self.max_start_failures = max_start_failures
        self.counts: Counter[str] = Counter()
        self._pool: DeadlinePool | None = None
        self._lock = threading.Lock()
        self._start_failures = 0  # in a row
        self._next_start = 0.0  # monotonic time before which no new pool starts

    def _fast(self, response: str | bytes, gold: str) -> float | str:
        """A score decided without math-verify, or the candidate answer it must judge."""
        self.counts["calls"] += 1
        text = as_text(response)
        if len(text) > MAX_RESPONSE_CHARS:
            self.counts["rejected"] += 1
            return 0.0
        gold = gold.strip()
        candidate = extract_answer(text)
        if candidate is None:
            return 0.0
        if len(candidate) > MAX_ANSWER_CHARS:
            self.counts["rejected"] += 1
            return 0.0
        if _strip(candidate) == _strip(gold):
            return 1.0
        gold_number, candidate_number = as_number(gold), as_number(candidate)
        if gold_number is not None and candidate_number is not None:
            return float(gold_number == candidate_number)
        return candidate

    def score_many(self, pairs: Iterable[tuple[str | bytes, str]]) -> list[float]:
        """Scores for (response, gold) pairs; the slow ones run in parallel in the pool."""
        pairs = list(pairs)
        decided = [self._fast(response, gold) for response, gold in pairs]
        slow = [i for i, d in enumerate(decided) if isinstance(d, str)]
        if slow:
            with self._lock:
                outcomes = self._judge([(decided[i], pairs[i][1].strip()) for i in slow])
            for i, outcome in zip(slow, outcomes, strict=True):
                if outcome.status != "ok":
                    self.counts[outcome.status + "s"] += 1
                    log.debug("verifier %s on answer %.80r: %s", outcome.status, decided[i], outcome.message)
                decided[i] = 1.0 if outcome.status == "ok" and outcome.value else 0.0
        return [float(d) for d in decided]

    def _judge(self, calls: list[tuple[str, str]]) -> list[Outcome]:
        """math-verify's verdicts in the pool; every call an error while its workers cannot start."""
        if self._pool is None and time.monotonic() < self._next_start:
            return [Outcome("error", message="verifier workers are backing off")] * len(calls)
        try:
            if self._pool is None:
                self._pool = DeadlinePool(self.TARGET, workers=self.workers, timeout=self.timeout)
            outcomes = self._pool.map(calls)
        except WorkerStartError as error:
            self._pool.close()
            self._pool = None
            self._start_failures += 1
            if self._start_failures >= self.max_start_failures:
                raise VerifierUnavailable(
                    f"the verifier's worker processes failed to start {self._start_failures} times in a row "
                    f"(last: {error}); is the machine overloaded, or can {self.TARGET} be imported?") from None
            wait = self.start_backoff * 2 ** (self._start_failures - 1)
            self._next_start = time.monotonic() + wait
            log.warning("verifier workers did not start (%s): %d responses count as verifier errors; "
                        "next try in %g s", error, len(calls), wait)
            return [Outcome("error", message=str(error))] * len(calls)
        self._start_failures = 0
        return outcomes

    def score(self, response: str | bytes, gold: str) -> float:
        return self.score_many([(response, gold)])[0]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


_default: Verifier | None = None


def default_verifier() -> Verifier:
    """The process-wide verifier behind `score` (its pool starts on first need)."""
    global _default
    if _default is None:
        _default = Verifier()
        atexit.register(_default.close)
    return _default


def score_choice(response: str | bytes, gold: str, letters: str = LETTERS) -> float:
    """1.0 if a multiple-choice response settles on the gold letter among the task's `letters`.

    Only a task that knows its choices scores letters: to `score`, a one-letter gold such as `e`
    (Euler's number) is a math answer."""
    text = as_text(response)
    if len(text) > MAX_RESPONSE_CHARS:
        return 0.0
    return float(choice_letter(text, letters) == gold.strip().upper())


def score(response: str | bytes, gold: str) -> float:
    """1.0 if the response's final answer equals `gold`, else 0.0; never raises, bounded in time."""
    try:
        return default_verifier().score(response, gold)
    except Exception:  # noqa: BLE001 - a scorer that raises would take a training run down
        log.exception("verifier failed; scoring 0")
        return 0.0


# --- countdown ---------------------------------------------------------------------------------

_COUNTDOWN_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult,
                    ast.Div, ast.USub, ast.UAdd)


def countdown_expression(text: str) -> str | None:
    """The expression a countdown response proposes: \\boxed{}, "the answer is", else its last line."""
    text = as_text(text)
    candidate = last_boxed(text) or answer_phrase(text)
    if candidate is None:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        candidate = lines[-1] if lines else None
    if candidate is None or len(candidate) > 200:
        return None
    return candidate.split("=")[0].strip().replace("\\times", "*").replace("\\div", "/").replace("\\cdot", "*")


def score_countdown(response: str | bytes, numbers: Sequence[int], target: int) -> float:
    """1.0 if the response's expression uses each of `numbers` exactly once and equals `target`."""
    expression = countdown_expression(response)
    if not expression:
        return 0.0
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0.0
    nodes = list(ast.walk(tree))
    if not all(isinstance(node, _COUNTDOWN_NODES) for node in nodes):
        return 0.0
    used = [node.value for node in nodes if isinstance(node, ast.Constant)]
    if not all(type(v) is int for v in used) or Counter(used) != Counter(numbers):
        return 0.0

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        left, right = value(node.left), value(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left / right

    try:
        return float(value(tree) == target)
    except (ZeroDivisionError, RecursionError):
        return 0.0
