"""Tasks: synthetic problems, MATH-format data from files, rewards, data order."""

import json

import pandas as pd
import pytest

from eval.verify import Verifier, score_countdown
from trainer.tasks import DataOrder, TaskDataError, make_task


@pytest.fixture(scope="module")
def verifier():
    v = Verifier()
    yield v
    v.close()


def test_arithmetic_is_seeded_and_correct(verifier):
    task = make_task("arithmetic", {"max_operand": 50, "ops": "+-*", "terms": 3})
    problems = [task.problem(i) for i in range(200)]
    assert problems == [task.problem(i) for i in range(200)]  # same index, same problem
    for p in problems:
        assert str(eval(p.question.rstrip("="))) == p.answer  # noqa: S307 - our own digits and operators
    assert task.reward([p.answer for p in problems[:5]], problems[:5], verifier) == [1.0] * 5
    assert make_task("arithmetic", {"seed": 1}).problem(0) != make_task("arithmetic").problem(0)


def test_natural_prompts_ask_in_words_for_a_boxed_answer_and_keep_the_problems(verifier):
    toy, natural = make_task("arithmetic", {"terms": 3}), make_task("arithmetic", {"terms": 3, "prompt": "natural"})
    p, q = toy.problem(7), natural.problem(7)
    assert p.answer == q.answer and p.meta == q.meta  # the same problem, asked another way
    assert q.question == f"What is {p.meta['expression'].replace('+', ' + ').replace('-', ' - ')}? Put your final " \
                         "answer within \\boxed{}."
    assert natural.target(q) == f"\\boxed{{{q.answer}}}" and toy.target(p) == p.answer
    assert natural.reward([f"So it is \\boxed{{{q.answer}}}.", "\\boxed{1000}"], [q, q], verifier) == [1.0, 0.0]
    countdown = make_task("countdown", {"prompt": "natural", "count": 2})
    c = countdown.problem(0)
    assert c.question.startswith("Using the numbers ") and "\\boxed{}" in c.question
    assert countdown.reward([f"\\boxed{{{c.answer}}}"], [c], verifier) == [1.0]
    with pytest.raises(TaskDataError, match="task.options.prompt: 'chat' is not one of toy, natural"):
        make_task("countdown", {"prompt": "chat"})


def test_countdown_problems_are_solvable_and_rewarded(verifier):
    task = make_task("countdown", {"count": 4, "max_number": 12})
    problems = [task.problem(i) for i in range(100)]
    assert all(score_countdown(p.answer, p.meta["numbers"], p.meta["target"]) == 1.0 for p in problems)
    assert task.reward([problems[0].answer, "1+1"], problems[:2], verifier) == [1.0, 0.0]
    assert problems[0].question.endswith(f"make {problems[0].meta['target']}:")


RECORDS = [
    {"problem": "What is $1+1$?", "answer": "2"},
    {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
]


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
def test_math_reads_local_files(tmp_path, suffix, verifier):
    path = tmp_path / f"math.{suffix}"
    if suffix == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    elif suffix == "json":
        path.write_text(json.dumps(RECORDS))
    else:
        pd.DataFrame(RECORDS).to_parquet(path)
    task = make_task("math", {"path": str(path)})
    assert len(task) == 2
    assert task.problem(1).answer == "\\frac{1}{2}"  # taken from the solution's \boxed{}
    assert task.target(task.problem(0)) == "The answer is \\boxed{2}."
    assert "\\boxed{}" in task.prompt(task.problem(0), tokenizer=None, chat=False)
    assert task.reward(["so \\boxed{0.5}", "\\boxed{3}"], [task.problem(1), task.problem(0)], verifier) == [1.0, 0.0]


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("", "has no records"),
    ('{"problem": "x", "answer": "1"}\n{not json\n', "line 2 is not valid JSON"),
    ('{"question": "x", "answer": "1"}\n', "has no 'problem' field"),
    ('{"problem": "x"}\n', "has neither 'answer' nor a \\\\boxed\\{\\} answer"),
])
def test_bad_math_data_gives_one_clear_error(tmp_path, content, message):
    path = tmp_path / "math.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TaskDataError, match=message):
        make_task("math", {"path": str(path)})


def test_math_limit_must_be_positive(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(TaskDataError, match="task.options.limit: must be a whole number >= 1, got 0"):
        make_task("math", {"path": str(path), "limit": 0})
    assert len(make_task("math", {"path": str(path), "limit": 5})) == 1


def test_unknown_task_and_options_name_the_key():
    with pytest.raises(TaskDataError, match="task.name: 'gsm8k' is not one of arithmetic, countdown, math"):
        make_task("gsm8k")
    with pytest.raises(TaskDataError, match="task.options: max_value not known to task 'arithmetic'"):
        make_task("arithmetic", {"max_value": 3})
    with pytest.raises(TaskDataError, match="task.options: arithmetic needs"):
        make_task("arithmetic", {"ops": "/"})


def test_data_order_covers_every_index_once_per_epoch_and_is_seeded():
    order = DataOrder(10, seed=3)
    first, second = order.take(0, 10), order.take(10, 10)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert DataOrder(10, seed=3).take(5, 10) == first[5:] + second[:5]  # a position is the whole state
    with pytest.raises(TaskDataError, match="empty"):
        DataOrder(0, seed=0)
