"""`train.stop_if`: a run ends as failed, with its reason, once its importance weights have degenerated for
several steps in a row, rather than train on toward a collapse that its reward shows only later.

The diagnostic is `ess` (trainer.run.metrics): the normalized effective sample size of the weights
pi_theta / mu of the step's sampled tokens, 1 when the trainer's policy is the one that sampled and
towards 0 as a few tokens carry all the weight (VCPO, arXiv 2602.17616, reports that it falls before an
off-policy run collapses). The streak is counted from metrics.jsonl, so a resumed run goes on counting
where it stopped."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainer.config import StopIf
from trainer.run.errors import TrainingError


class StoppedByRule(TrainingError):
    """The run met its `train.stop_if`: recorded in FAILED as its reason (`sweep status` shows it)."""


class StopRule:
    """Counts the steps in a row whose `ess` lies below `rule.ess_below`; `check` raises StoppedByRule at
    `rule.for_steps` of them. A rule with `ess_below` 0 never stops a run."""

    def __init__(self, rule: StopIf, history: Iterable[dict[str, Any]] = ()) -> None:
        self.rule = rule
        self.streak: list[tuple[int, float]] = []  # (step, ess) of the steps in a row below the bound
        for metrics in history:
            self._count(metrics)

    def _count(self, metrics: dict[str, Any]) -> None:
        ess = metrics.get("ess")
        if ess is not None and ess < self.rule.ess_below:
            self.streak = [*self.streak, (metrics["step"], ess)][-self.rule.for_steps:]
        else:
            self.streak = []

    def check(self, metrics: dict[str, Any]) -> None:
        """Count this step's metrics line; raise StoppedByRule when the streak is long enough."""
        if not self.rule.ess_below:
            return
        self._count(metrics)
        if len(self.streak) >= self.rule.for_steps:
            (first, _), (last, _) = self.streak[0], self.streak[-1]
            values = ", ".join(f"{ess:.3g}" for _, ess in self.streak)
            steps = f"step {last}" if first == last else f"steps {first} to {last}"
            raise StoppedByRule(
                f"train.stop_if: ess below {self.rule.ess_below} for {self.rule.for_steps} step(s) in a row "
                f"({values} at {steps}): the importance weights of its rollouts have degenerated, so the run "
                "stopped as failed (to train it again from scratch: --config rerun=<run id>)")
