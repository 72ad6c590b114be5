"""The KL coefficient beta: fixed, or adapted to a target KL as the run trains (objective.kl_target).

The adaptive controller of Ziegler et al. (2019), as verl, OpenRLHF and SkyRL implement it: after
each step, with KL the batch's mean over responses of their per-token mean KL estimate,

    beta <- beta * (1 + clip(KL / kl_target - 1, -0.2, 0.2) * responses / kl_horizon)

so beta grows while the policy is further from the reference than the target and shrinks while it
is closer. The objective E[R] - beta KL then changes as the run trains: its optimum is that of the
beta the run ends with, and `measure` reports J* and the gap at the beta of each measured step.
Its state (beta) is saved in every checkpoint, so a resumed run continues with the same beta.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trainer.objective.objective_config import ObjectiveConfig

ERROR_CLIP = 0.2  # the controller's bound on the proportional error (the libraries' np.clip(..., -0.2, 0.2))


class KLCoefficient:
    """beta as a run trains: `value` is the coefficient of the next step; `update` after each step."""

    def __init__(self, config: ObjectiveConfig) -> None:
        self.value = float(config.beta)
        self.target, self.horizon = config.kl_target, config.kl_horizon
        self.adaptive = config.adaptive

    def objective(self, config: ObjectiveConfig) -> ObjectiveConfig:
        """The run's objective at the current beta."""
        return replace(config, beta=self.value) if self.adaptive and config.beta != self.value else config

    def update(self, current_kl: float, responses: int) -> None:
        """After a step whose responses had mean per-token KL `current_kl`: the controller's step."""
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target - 1.0, -ERROR_CLIP), ERROR_CLIP)
        self.value *= 1.0 + error * responses / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
