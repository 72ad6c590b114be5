"""Answer extraction, equivalence, countdown scoring, and the hostile-output corpus."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval.verify import (
    Verifier,
    VerifierUnavailable,
    as_number,
    choice_letter,
    extract_answer,
    last_boxed,
    score,
    score_choice,
    score_countdown,
)
from eval.workers import DeadlinePool


@pytest.fixture(scope="module")
def verifier():
    v = Verifier(timeout=5.0)
    yield v
    v.close()


@pytest.mark.parametrize("text,answer", [
    ("so \\boxed{\\frac{1}{2}} it is", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{\\{2, 3\\}}", "\\{2, 3\\}"),
    ("The answer is: $42$.", "42"),
    ("Final answer: x = 7", "x = 7"),
    ("we get 3, then 1,234 apples", "1234"),
    ("\\boxed{2} and then \\boxed{3", "2"),        # the last *complete* box
    ("\\boxed{3 and more \\boxed{", None),          # a box that never closes is no answer
    ("no numbers here", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("response,gold", [
    ("\\boxed{0.5}", "\\frac{1}{2}"),               # fractions against decimals
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34"),
    ("\\boxed{-\\frac{1}{2}}", "-0.5"),
    ("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}"),      # sets
    ("\\boxed{(0, 1]}", "(0,1]"),                    # intervals
    ("\\boxed{50\\%}", "50"),                        # percentages
    ("\\boxed{5 \\text{ cm}}", "5"),                  # units
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),  # LaTeX variants
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),                # equivalent expressions
    ("The answer is 1,000", "1000"),
    ("The answer is (C)", "C"),                      # multiple choice
    ("I pick \\boxed{B}", "B"),
])
def test_equivalent_answers_score_one(verifier, response, gold):
    assert verifier.score(response, gold) == 1.0


@pytest.mark.parametrize("response,gold", [
    ("\\boxed{0.3333}", "\\frac{1}{3}"),             # close is not equal
    ("\\boxed{(0, 1)}", "(0,1]"),                     # open vs half-open
    ("\\boxed{\\{1, 2\\}}", "\\{1,2,3\\}"),
    ("\\boxed{x^2+1}", "(x+1)^2"),
    ("\\boxed{2\\pi}", "6.28"),
    ("\\boxed{-3}", "3"),
    ("The answer is (B)", "C"),
    ("", "3"),
])
def test_wrong_answers_stay_wrong(verifier, response, gold):
    assert verifier.score(response, gold) == 0.0


def test_numbers_are_decided_exactly_without_math_verify():
    assert as_number("\\frac{6}{8}") == as_number("0.75") == as_number("3/4")
    assert as_number("-\\frac{1}{2}") == as_number("-.5")
    assert as_number("1,000") == 1000 and as_number("x") is None and as_number("1/0") is None
    v = Verifier()
    assert v.score("so it is 12", "12.0") == 1.0 and v._pool is None  # no worker was needed


def test_choice_letter_patterns():
    assert choice_letter("Let me think... the answer is (D).") == "D"
    assert choice_letter("\\boxed{\\text{A}}") == "A"
    assert choice_letter("B") == "B"
    assert choice_letter("nothing chosen") is None


CHOICE_CORPUS = [json.loads(line) for line in (Path(__file__).parent / "data" / "choice_corpus.jsonl").open()]


@pytest.mark.parametrize("case", CHOICE_CORPUS, ids=[f"{c['gold']}:{c['response'][:40]}" for c in CHOICE_CORPUS])
def test_multiple_choice_corpus(case):
    """Realistic answers (boxed, "Answer: X", "the correct option is (x)", markdown, self-corrections,
    other options discussed, letters that are words): the old extraction got 9 of these 31 wrong."""
    assert score_choice(case["response"], case["gold"], case["letters"]) == case["expected"]


def test_a_one_letter_math_answer_is_not_a_choice():
    """`e` is Euler's number in a math task: only a multiple-choice task scores letters."""
    assert score("so the limit is \\boxed{e}", "e") == 1.0
    assert score("so the limit is \\boxed{2}", "e") == 0.0


def test_score_never_raises_and_takes_bytes():
    assert score(b"\xff\xfe \\boxed{7}", "7") == 1.0  # invalid UTF-8 is decoded with replacement
    assert score(None, "7") == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize("response,numbers,target,expected", [
    ("3*5+7", [3, 5, 7], 22, 1.0),
    ("(3 + 5) * 7 = 56", [3, 5, 7], 56, 1.0),
    ("The answer is \\boxed{7 \\times 5 - 3}", [3, 5, 7], 32, 1.0),
    ("21/7*5", [5, 7, 21], 15, 1.0),
    ("3*5+7", [3, 5, 7], 23, 0.0),       # wrong value
    ("3*5", [3, 5, 7], 15, 0.0),         # a number left out
    ("3*5+7+7", [3, 5, 7], 29, 0.0),     # a number used twice
    ("3**5", [3, 5], 243, 0.0),          # only + - * /
    ("__import__('os').system('x')", [1], 1, 0.0),
    ("7/(5-5)", [7, 5, 5], 0, 0.0),      # division by zero
])
def test_countdown_scoring(response, numbers, target, expected):
    assert score_countdown(response, numbers, target) == expected


HOSTILE = {
    "100 kB of digits": "7" * 100_000,
    "50 kB number": "the answer is " + "9" * 50_000,
    "deeply nested braces": "\\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",
    "huge exponent": "\\boxed{10^{10^{10^{10^{10}}}}}",
    "factorial tower": "\\boxed{((((9!)!)!)!)}",
    "invalid utf-8": b"\xff\xfe\xfd \\boxed{\xc3\x28}",
    "never-ending LaTeX": "\\boxed{" + "\\frac{1}{" * 30_000,
    "unbalanced sqrt": "The answer is \\sqrt{\\sqrt{\\sqrt{" * 1000,
    "null bytes": "\\boxed{\x00\x00\x00}",
}


def test_hostile_outputs_score_zero_within_the_bound_and_are_counted():
    verifier = Verifier(timeout=2.0, workers=2)
    try:
        start = time.monotonic()
        scores = verifier.score_many([(response, "3") for response in HOSTILE.values()])
        elapsed = time.monotonic() - start
    finally:
        verifier.close()
    assert scores == [0.0] * len(HOSTILE)
    # two workers, each call at most 2 s, plus worker start-up: far below one call per second each
    assert elapsed < 2.0 * len(HOSTILE) / 2 + 20
    counts = verifier.counts
    assert counts["rejected"] >= 1  # the over-long response and answer
    assert counts["timeouts"] + counts["errors"] >= 1  # the exponent tower cannot be evaluated in time
    assert counts["calls"] == len(HOSTILE)


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


def _crash():
    import os

    os._exit(3)


def _raise():
    raise RecursionError("deep")


def test_deadline_pool_kills_hung_workers_and_survives_crashes():
    with DeadlinePool("tests.test_verify:_sleep", workers=2, timeout=1.0) as pool:
        start = time.monotonic()
        outcomes = pool.map([(0.01,), (30,), (0.02,), (30,), (0.01,)])
        assert time.monotonic() - start < 10
        assert [o.status for o in outcomes] == ["ok", "timeout", "ok", "timeout", "ok"]
        assert outcomes[0].value == 0.01
        assert [o.status for o in pool.map([(0.0,)] * 4)] == ["ok"] * 4  # replaced workers work
    with DeadlinePool("tests.test_verify:_crash", workers=1, timeout=5.0) as pool:
        assert [o.status for o in pool.map([(), ()])] == ["error", "error"]
    with DeadlinePool("tests.test_verify:_raise", workers=1, timeout=5.0) as pool:
        outcome = pool.map([()])[0]
        assert outcome.status == "error" and "RecursionError" in outcome.message


def test_a_workers_startup_is_not_counted_against_its_calls():
    """Calls right after a replacement must not time out while the new worker is still importing."""
    with DeadlinePool("tests.slow_import_target:echo", workers=1, timeout=1.0) as pool:
        assert [o.status for o in pool.map([(1,), (2,)])] == ["ok", "ok"]
    with DeadlinePool("tests.no_such_module:f", workers=1, timeout=1.0) as pool:
        with pytest.raises(RuntimeError, match="failed to start: can it be imported"):
            pool.map([()])


def test_workers_that_cannot_start_count_as_errors_then_back_off_then_stop_the_caller():
    """A pool that cannot start must not end a training run at once: its responses score 0 as verifier
    errors, the next start waits (doubling), a success resets the count, and only
    `max_start_failures` failures in a row raise, with one message."""
    pair = ("so \\boxed{x^2+1}", "1+x^2")  # needs math-verify: not decided by the fast path
    verifier = Verifier(start_backoff=0.3, max_start_failures=2)
    verifier.TARGET = "tests.no_such_module:f"
    assert verifier.score_many([pair, ("\\boxed{4}", "4")]) == [0.0, 1.0]  # only the slow one is lost
    assert verifier.counts["errors"] == 1
    assert verifier.score_many([pair]) == [0.0] and verifier.counts["errors"] == 2  # backing off: no start
    time.sleep(0.35)
    verifier.TARGET = Verifier.TARGET  # the machine recovered
    assert verifier.score_many([pair]) == [1.0] and verifier.counts["errors"] == 2
    verifier.close()
    verifier.TARGET = "tests.no_such_module:f"
    assert verifier.score_many([pair]) == [0.0]  # one failure in a row again, not two
    time.sleep(0.35)
    with pytest.raises(VerifierUnavailable, match="failed to start 2 times in a row .*can it be imported"):
        verifier.score_many([pair])


def test_last_boxed_is_linear_on_long_inputs():
    start = time.monotonic()
    assert last_boxed("\\boxed{" * 20_000) is None
    assert time.monotonic() - start < 5


# (response, gold, score): none is decided without math-verify, so every one is a call in the pool
SLOW_PAIRS = [("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0), ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
              ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0), ("\\boxed{2\\pi}", "6.28", 0.0),
              ("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}", 1.0), ("\\boxed{(0, 1)}", "(0,1]", 0.0),
              ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0), ("\\boxed{x^2+2x}", "(x+1)^2", 0.0)]

SCORER = f"""
import json, signal
from eval.verify import Verifier
sigterms = []
signal.signal(signal.SIGTERM, lambda *_: sigterms.append(1))  # the trainer's SigtermFlag: finish the step
verifier = Verifier(timeout=60.0, workers=2)
verifier.TARGET = "tests.verify_signal_target:equivalent_slowly"
scores = verifier.score_many({[(r, g) for r, g, _ in SLOW_PAIRS]!r})
verifier.close()
print(json.dumps({{"scores": scores, "sigterms": len(sigterms), "counts": dict(verifier.counts)}}))
"""


def _wait_for(marks: Path, prefix: str, process: subprocess.Popen) -> bool:
    """Whether a mark starting with `prefix` appeared before the scorer ended (within 120 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if any(path.name.startswith(prefix) for path in marks.iterdir()):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("moment", ["starting", "busy"])
def test_a_sigterm_to_the_process_group_leaves_every_reward_right(tmp_path, moment):
    """On SLURM a job is stopped by SIGTERM to its whole process group, the verifier's workers included; the
    trainer finishes its step and checkpoints it, so that step's rewards must all be right: a worker caught
    while starting (importing sympy) or in the middle of a call must neither die nor fail its calls."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, KLSTUDY_TEST_MARKS=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    scorer = subprocess.Popen([sys.executable, "-c", SCORER], cwd=root, env=env, stdout=subprocess.PIPE,
                              start_new_session=True)  # a group of its own, as a SLURM job's command
    try:
        assert _wait_for(tmp_path, moment, scorer), f"no worker was {moment}"
        os.killpg(scorer.pid, signal.SIGTERM)
        out, _ = scorer.communicate(timeout=300)
    finally:
        if scorer.poll() is None:
            os.killpg(scorer.pid, signal.SIGKILL)
    assert scorer.returncode == 0
    result = json.loads(out)
    assert result["sigterms"] == 1
    assert result["scores"] == [score for _, _, score in SLOW_PAIRS], result["counts"]
