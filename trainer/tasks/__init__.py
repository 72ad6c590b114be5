"""Prompt sources and their rewards: arithmetic, countdown, math."""

from __future__ import annotations

import inspect
from typing import Any

from trainer.choices import TASK_NAMES
from trainer.tasks.arithmetic import Arithmetic
from trainer.tasks.base import DataOrder, Problem, Task, TaskDataError
from trainer.tasks.countdown import Countdown
from trainer.tasks.math_problems import MathProblems

TASKS: dict[str, type[Task]] = dict(zip(TASK_NAMES, (Arithmetic, Countdown, MathProblems), strict=True))

__all__ = ["TASKS", "DataOrder", "Problem", "Task", "TaskDataError", "make_task"]


def make_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """The task called `name` built from its options; unknown names or options name the key."""
    if name not in TASKS:
        raise TaskDataError(f"task.name: {name!r} is not one of {', '.join(TASKS)}")
    cls = TASKS[name]
    options = dict(options or {})
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TaskDataError(f"task.options: {', '.join(unknown)} not known to task {name!r} "
                            f"(it takes {', '.join(sorted(accepted))})")
    try:
        return cls(**options)
    except TypeError as error:
        raise TaskDataError(f"task.options: {error}") from None
