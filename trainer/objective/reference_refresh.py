"""Refreshing the reference from the policy as a run trains (objective.ref_refresh_every).

Every `ref_refresh_every` steps the reference becomes pi_ref <- alpha pi_theta + (1 - alpha) pi_ref,
parameter by parameter (objective.ref_refresh_alpha): alpha 1 is slime's hard copy
(--ref-update-interval), alpha 0.6 TRL's sync_ref_model and open-instruct's Polyak update. The KL
then measures the distance to a recent policy: a proximal term, no longer a pull back to the model
the run started from, and pi* = pi_ref exp(R / beta) / Z of the original reference is not a fixed
point. `measure` keeps measuring the KL to the original reference and the gap to its optimum, which
shows how far a run departs from it (docs/peers.md).

The reference's weights are part of the run's state: they are saved in every checkpoint and loaded
on resume.
"""

from __future__ import annotations

from typing import Iterable

import torch

from trainer.objective.objective_config import ObjectiveConfig


def due(config: ObjectiveConfig, steps_done: int) -> bool:
    """Whether the reference is refreshed after `steps_done` training steps."""
    every = config.ref_refresh_every
    return every is not None and config.placement != "none" and steps_done > 0 and steps_done % every == 0


@torch.no_grad()
def mix_(reference: Iterable[torch.Tensor], policy: Iterable[torch.Tensor], alpha: float) -> None:
    """reference <- alpha policy + (1 - alpha) reference, tensor by tensor, in place (1: a copy)."""
    for ref, new in zip(reference, policy, strict=True):
        if alpha == 1.0:
            ref.copy_(new)
        else:
            ref.mul_(1.0 - alpha).add_(new.to(ref.dtype), alpha=alpha)


def refresh(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """Mix `policy`'s parameters into `reference`'s (two copies of one architecture, sharded alike)."""
    mix_(reference.parameters(), policy.parameters(), alpha)
