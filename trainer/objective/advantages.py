"""Advantage estimators over groups of responses to the same prompt: one registration each.

`rewards` has shape [B] with B = prompts x group_size, each group in consecutive rows. Every
estimator returns a [B] tensor. RLOO is the one under which the KL identities of KL_THEORY.md
hold exactly: its baseline is independent of the sample it is subtracted from.

An estimator's `scope` says which rows it reads: "group" ones read only a response's own group;
"batch" ones (REINFORCE++'s normalisation) read every row of the minibatch, over all its
micro-batches and processes, which is why the trainer computes advantages once per minibatch
(`trainer.objective.loss.batch_advantages`), never per micro-batch. Tensor methods only: no torch import,
so that configs validate without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from trainer.objective.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """View [B] rewards as [prompts, group_size], with a clear error when B does not divide."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [B], got {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"batch of {rewards.numel()} rewards is not a whole number of groups of {group_size}"
        )
    return rewards.view(-1, group_size)


def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """R_i minus the mean reward of the other members of its group (leave-one-out)."""
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    g = _groups(rewards, group_size)
    others_mean = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - others_mean).reshape(-1)


def drgrpo(rewards: Tensor, group_size: int) -> Tensor:
    """R_i minus the group mean (Dr. GRPO): (G-1)/G times the RLOO advantage."""
    g = _groups(rewards, group_size)
    return (g - g.mean(dim=1, keepdim=True)).reshape(-1)


def grpo(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """(R_i - group mean) / (group std + eps); with scale=False the same as drgrpo.

    The std is the unbiased sample std, as in TRL and DeepSeekMath.
    """
    if not scale:
        return drgrpo(rewards, group_size)
    if group_size < 2:
        raise ValueError(f"grpo with std scaling needs group_size >= 2, got {group_size}")
    g = _groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    return (centred / (g.std(dim=1, keepdim=True) + eps)).reshape(-1)


def reinforce(rewards: Tensor, group_size: int) -> Tensor:
    """The reward itself: no baseline."""
    return _groups(rewards, group_size).reshape(-1).clone()


def reinforce_plus_plus(rewards: Tensor, group_size: int, eps: float = 1e-4) -> Tensor:
    """REINFORCE++ with a group baseline (Hu et al. 2025; verl's reinforce_plus_plus_baseline): R_i minus
    its group's mean, divided by the standard deviation of those over the whole batch."""
    if rewards.numel() < 2:
        raise ValueError(f"reinforce++ normalises over the batch and needs >= 2 rows, got {rewards.numel()}")
    centred = drgrpo(rewards, group_size)
    return centred / (centred.std() + eps)


@dataclass(frozen=True)
class Advantage:
    name: str
    compute: Callable[..., Tensor]  # (rewards [B], group_size, **options) -> [B]
    scope: str = "group"            # "group": reads its group only; "batch": every row of the minibatch
    scaled: bool = False            # takes grpo_scale (divide by the group std)


REGISTRY: Registry[Advantage] = Registry("advantage")
REGISTRY.register(Advantage("rloo", rloo))
REGISTRY.register(Advantage("grpo", grpo, scaled=True))
REGISTRY.register(Advantage("drgrpo", drgrpo))
REGISTRY.register(Advantage("reinforce", reinforce))
REGISTRY.register(Advantage("reinforce++", reinforce_plus_plus, scope="batch"))


def compute(name: str, rewards: Tensor, group_size: int, *, grpo_scale: bool = True) -> Tensor:
    """The advantages of estimator `name` over all the rows it reads, or a ValueError listing the choices."""
    spec = REGISTRY[name]
    if spec.scaled:
        return spec.compute(rewards, group_size, scale=grpo_scale)
    return spec.compute(rewards, group_size)
