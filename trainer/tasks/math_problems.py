"""MATH-format problems from a local jsonl/parquet file or a hub data set, answers in \\boxed{}."""

from __future__ import annotations

from eval.data import DataError, read_records
from eval.prompts import MATH_INSTRUCTION
from eval.verify import last_boxed
from trainer.tasks.base import Problem, Task, TaskDataError


class MathProblems(Task):
    """Problems in `problem_key`; gold answers in `answer_key`, else the \\boxed{} of `solution_key`."""

    name = "math"
    instruction = MATH_INSTRUCTION

    def __init__(self, path: str, split: str = "train", subset: str | None = None, problem_key: str = "problem",
                 answer_key: str = "answer", solution_key: str = "solution", limit: int | None = None) -> None:
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise TaskDataError(f"task.options.limit: must be a whole number >= 1, got {limit!r}")
        try:
            records = read_records(path, split, subset, what="task.options.path")
        except DataError as error:
            raise TaskDataError(str(error)) from None
        if limit is not None:
            records = records[:limit]
        self.problems: list[Problem] = []
        for number, record in enumerate(records, start=1):
            if not isinstance(record, dict) or problem_key not in record:
                raise TaskDataError(f"task.options.path: record {number} of {path} has no {problem_key!r} field "
                                    "(set task.options.problem_key)")
            answer = record.get(answer_key)
            if answer is None and isinstance(record.get(solution_key), str):
                answer = last_boxed(record[solution_key])
            if answer is None:
                raise TaskDataError(f"task.options.path: record {number} of {path} has neither {answer_key!r} nor a "
                                    f"\\boxed{{}} answer in {solution_key!r}")
            self.problems.append(Problem(str(record[problem_key]), str(answer)))

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, index: int) -> Problem:
        return self.problems[index]

    def target(self, problem: Problem) -> str:
        return f"The answer is \\boxed{{{problem.answer}}}."
