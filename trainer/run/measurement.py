"""The regularized objective measured on held-out prompts (measure.*): the reference's side once, then the
policy's at the steps the loop asks for. Kept apart from the step: it never changes what the run trains."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.verify import Verifier, VerifierUnavailable
from trainer.measure.objective import ObjectiveProbe
from trainer.run.errors import TrainingError
from trainer.run.policies import Policies
from trainer.run_files import OBJECTIVE_REFERENCE


@dataclass
class ObjectiveMeasurement:
    """The probe of a run's held-out prompts, with the engine that samples and the verifier that scores
    them; `reference_record`: the reference's side, once `prepare` has read or made it."""

    probe: ObjectiveProbe
    engine: Any
    verifier: Verifier
    out: Path
    main: bool
    reference_record: dict[str, Any] | None = None

    def prepare(self, step: int) -> None:
        """The reference's reward histograms of the held-out prompts: read back, or sampled now while the
        policy is the reference (before the first update, `step` 0) and written once."""
        path = self.out / OBJECTIVE_REFERENCE
        if path.is_file():
            self.reference_record = json.loads(path.read_text())
            return
        if step != 0:
            raise TrainingError(f"{path} is missing: the reference's rewards are sampled before the first update; "
                                "start the run again in a new --out")
        t0 = time.perf_counter()
        try:
            record = self.probe.reference_record(self.engine, self.verifier)
        except VerifierUnavailable as error:
            raise TrainingError(str(error)) from None
        record["measure_time"] = time.perf_counter() - t0
        if self.main:
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps(record) + "\n")
            partial.replace(path)
        self.reference_record = record

    def measure(self, step: int, policies: Policies, beta: float) -> dict[str, Any]:
        """One line of objective.jsonl: the policy's objective after `step` updates, at `beta` (adaptive: the
        beta of this step), against the reference the run started from."""
        t0 = time.perf_counter()
        try:
            line = self.probe.measure(step, self.engine, policies.policy, policies.original_reference,
                                      self.verifier, policies.device, self.reference_record, beta=beta)
        except VerifierUnavailable as error:
            raise TrainingError(str(error)) from None
        line["measure_time"] = time.perf_counter() - t0
        return line
