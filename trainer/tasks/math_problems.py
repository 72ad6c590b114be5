"""MATH-format problems from a local jsonl/parquet file or a hub data set, answers in \\boxed{}."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eval.verify import last_boxed
from trainer.tasks.base import Problem, Task, TaskDataError

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def read_records(path: str, split: str = "train", subset: str | None = None) -> list[dict[str, Any]]:
    """Records of a .jsonl / .json / .parquet file, or of a hub data set (name, optional subset)."""
    file = Path(path).expanduser()
    if file.suffix in (".jsonl", ".json", ".parquet") or file.exists():
        if not file.is_file():
            raise TaskDataError(f"task.options.path: no such file {file}")
        if file.suffix == ".parquet":
            import pandas as pd

            try:
                frame = pd.read_parquet(file)
            except Exception as error:  # noqa: BLE001 - pyarrow raises many kinds
                raise TaskDataError(f"task.options.path: {file} is not a readable parquet file ({error})") from None
            # a column missing from some records reads as NaN: make it absent, not the answer "nan"
            return [{k: v for k, v in record.items() if not (isinstance(v, float) and v != v)}
                    for record in frame.to_dict("records")]
        if file.suffix == ".json":
            try:
                data = json.loads(file.read_text())
            except json.JSONDecodeError as error:
                raise TaskDataError(f"task.options.path: {file} is not valid JSON ({error})") from None
            if not isinstance(data, list):
                raise TaskDataError(f"task.options.path: {file} must hold a JSON list of records")
            return data
        records = []
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise TaskDataError(f"task.options.path: {file} line {number} is not valid JSON") from None
        return records
    try:
        import datasets
    except ImportError:
        raise TaskDataError(f"task.options.path: {path!r} is not a file, and the `datasets` package that "
                            "would load it from the hub is not installed") from None
    try:
        return list(datasets.load_dataset(path, subset, split=split))
    except Exception as error:  # noqa: BLE001 - hub, network and format errors alike
        raise TaskDataError(f"task.options.path: could not load data set {path!r} split {split!r}: {error}") from None


class MathProblems(Task):
    """Problems in `problem_key`; gold answers in `answer_key`, else the \\boxed{} of `solution_key`."""

    name = "math"
    instruction = INSTRUCTION

    def __init__(self, path: str, split: str = "train", subset: str | None = None, problem_key: str = "problem",
                 answer_key: str = "answer", solution_key: str = "solution", limit: int | None = None) -> None:
        records = read_records(path, split, subset)
        if limit is not None:
            records = records[:limit]
        if not records:
            raise TaskDataError(f"task.options.path: {path} has no records")
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
