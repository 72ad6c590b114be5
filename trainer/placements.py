"""Where beta x the KL estimate goes: one registration per placement (see KL_THEORY.md).

In the reward, the estimate is subtracted from each response's reward (detached), so it reaches
the gradient through the advantages, as a score-function term; in the loss, its own gradient is
added. Free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.registry import Registry


@dataclass(frozen=True)
class Placement:
    name: str
    in_reward: bool
    in_loss: bool
    fill: str  # the marker fill that figures draw it with ("full", "none", "left")


REGISTRY: Registry[Placement] = Registry("KL placement")
REGISTRY.register(Placement("none", in_reward=False, in_loss=False, fill="full"))
REGISTRY.register(Placement("reward", in_reward=True, in_loss=False, fill="full"))
REGISTRY.register(Placement("loss", in_reward=False, in_loss=True, fill="none"))
REGISTRY.register(Placement("reward+loss", in_reward=True, in_loss=True, fill="left"))

KL_PLACEMENTS = tuple(p.name for p in REGISTRY if p.in_reward or p.in_loss)  # every placement with a KL term
