"""A verifier target that says when its worker starts and when a call is in flight (files in
KLSTUDY_TEST_MARKS), for the test that SIGTERMs the process group of a pool at those moments."""

import os
import time
from pathlib import Path

MARKS = Path(os.environ["KLSTUDY_TEST_MARKS"])
(MARKS / f"starting-{os.getpid()}").touch()

import math_verify  # noqa: E402, F401 - sympy's imports: seconds of a worker's start, when a signal can land

from eval.verify import math_equivalent  # noqa: E402


def equivalent_slowly(candidate: str, gold: str) -> bool:
    (MARKS / f"busy-{os.getpid()}").touch()
    time.sleep(0.5)
    return math_equivalent(candidate, gold)
