"""The regularized objective measured on held-out prompts (measure.*): the reference's side once, then the
policy's at the steps the loop asks for. Kept apart from the step: it never changes what the run trains."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from eval.verify import VerifierUnavailable
from trainer.run.errors import TrainingError
from trainer.run_files import OBJECTIVE_REFERENCE

if TYPE_CHECKING:
    from trainer.run.loop import Run


def prepare(run: "Run") -> dict[str, Any]:
    """The reference's reward histograms of the held-out prompts: read back, or sampled now while the
    policy is the reference (before the first update) and written once."""
    path = run.out / OBJECTIVE_REFERENCE
    if path.is_file():
        return json.loads(path.read_text())
    if run.state.step != 0:
        raise TrainingError(f"{path} is missing: the reference's rewards are sampled before the first update; "
                            "start the run again in a new --out")
    t0 = time.perf_counter()
    try:
        record = run.probe.reference_record(run.engine, run.verifier)
    except VerifierUnavailable as error:
        raise TrainingError(str(error)) from None
    record["measure_time"] = time.perf_counter() - t0
    if run.world.main:
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(record) + "\n")
        partial.replace(path)
    return record


def measure(run: "Run") -> dict[str, Any]:
    """One line of objective.jsonl: the policy's objective after `run.state.step` updates."""
    t0 = time.perf_counter()
    policies = run.policies
    try:
        # at the current beta (adaptive: the beta of this step), against the reference the run started from
        line = run.probe.measure(run.state.step, run.engine, policies.policy, policies.original_reference,
                                 run.verifier, policies.device, run.reference_record,
                                 beta=run.state.coefficient.objective(run.config.objective).beta)
    except VerifierUnavailable as error:
        raise TrainingError(str(error)) from None
    line["measure_time"] = time.perf_counter() - t0
    return line
