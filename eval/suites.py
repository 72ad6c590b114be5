"""The evaluation tasks and suites, defined in one place."""

from __future__ import annotations

IN_DOMAIN = ("math500", "math2")
OUT_OF_DOMAIN = ("mmlu_college_physics", "mmlu_college_chemistry", "mmlu_college_biology")
TASKS = (*IN_DOMAIN, *OUT_OF_DOMAIN, "countdown", "arith", "arith_natural", "countdown_natural")
SUITES: dict[str, tuple[str, ...]] = {
    "in_domain": IN_DOMAIN,
    "out_of_domain": OUT_OF_DOMAIN,
    "all": (*IN_DOMAIN, *OUT_OF_DOMAIN),
    "toy": ("arith",),
}
# The fields each task's records need (a tuple: any one of them will do).
REQUIRED_FIELDS: dict[str, list[tuple[str, ...]]] = {
    "math500": [("problem",), ("answer", "solution")],
    "math2": [("problem",), ("answer", "solution")],
    "mmlu_college_physics": [("question",), ("choices",), ("answer",)],
    "mmlu_college_chemistry": [("question",), ("choices",), ("answer",)],
    "mmlu_college_biology": [("question",), ("choices",), ("answer",)],
    "countdown": [("nums", "numbers"), ("target",)],
    "arith": [("question",), ("answer",)],
    "arith_natural": [("question",), ("answer",)],
    "countdown_natural": [("nums", "numbers"), ("target",)],
}
# Tasks with no public default data set: their data must be given (python -m eval run --data TASK=PATH).
NEEDS_DATA = ("math2", "arith", "arith_natural")


class SuiteError(ValueError):
    """An unknown suite or task name."""


def expand(names: list[str]) -> list[str]:
    """Suites and task names -> task names, in order, without repeats."""
    tasks: list[str] = []
    for name in names:
        if name in SUITES:
            tasks.extend(SUITES[name])
        elif name in TASKS:
            tasks.append(name)
        else:
            raise SuiteError(f"--suite: {name!r} is neither a suite ({', '.join(SUITES)}) nor a task "
                             f"({', '.join(TASKS)})")
    return list(dict.fromkeys(tasks))
