"""Advantage estimators over groups of responses to the same prompt: one registration each.

`rewards` has shape [B] with B = prompts x group_size, each group in consecutive rows. Every
estimator returns a [B] tensor. RLOO is the one under which the KL identities hold exactly
(docs/concepts/theory.md, "When the identities are exact"): its baseline is independent of the
sample it is subtracted from.

A whitening estimator (`whiten`) computes its [B] values as its base does (`compute`: no baseline, or
the group mean), and the KL joins them as the placement says; then the combined per-token return is
whitened over every response token of the minibatch (`trainer.objective.whitening`): the PPO-style
libraries' default estimators where the KL is in per-token rewards (verl's GAE with no critic and its
REINFORCE++, OpenRLHF's gae, reinforce and reinforce_baseline, NeMo-RL's and slime's REINFORCE++).

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
from trainer.objective.whitening import POPULATION, SAMPLE, Whitening

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


def _check_pairs(name: str, group_size: int) -> None:
    """The rule, stated once: a baseline from the others of a group, or the group's spread, needs two samples."""
    if group_size < 2:
        raise ValueError(f"advantage {name} needs group_size >= 2, got {group_size}")


def rloo(rewards: Tensor, group_size: int) -> Tensor:
    """R_i minus the mean reward of the other members of its group (leave-one-out)."""
    _check_pairs("rloo", group_size)
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
    _check_pairs("grpo", group_size)
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
    paired: bool = False            # needs two samples per group (with grpo_scale, when scaled)
    whiten: Whitening | None = None  # the combined per-token return whitened over the minibatch's tokens
    summary: str = ""

    def __post_init__(self) -> None:
        if self.whiten is not None and self.scope != "batch":
            raise ValueError(f"advantage {self.name!r}: a whitening estimator reads every row (scope batch)")


REGISTRY: Registry[Advantage] = Registry("advantage")
REGISTRY.register(Advantage("rloo", rloo, paired=True))
REGISTRY.register(Advantage("grpo", grpo, scaled=True, paired=True))
REGISTRY.register(Advantage("drgrpo", drgrpo))
REGISTRY.register(Advantage("reinforce", reinforce))
REGISTRY.register(Advantage("reinforce++", reinforce_plus_plus, scope="batch"))
# GAE with no critic (values 0) and gamma = lambda = 1, verl's and OpenRLHF's defaults, is the return itself:
# the same as REINFORCE++ without a baseline (verl core_algos.py:215-264 and :583-619; OpenRLHF
# experience_maker.py, get_advantages_and_returns and get_cumulative_returns)
REGISTRY.register(Advantage(
    "reinforce-whiten", reinforce, scope="batch", whiten=SAMPLE,
    summary="the return R - beta KL, whitened with the sample variance: verl's GAE (no critic) and REINFORCE++, "
            "slime's reinforce_plus_plus"))
REGISTRY.register(Advantage(
    "drgrpo-whiten", drgrpo, scope="batch", whiten=SAMPLE,
    summary="R minus its group mean, then the KL, whitened with the sample variance: verl's and slime's "
            "reinforce_plus_plus_baseline"))
REGISTRY.register(Advantage(
    "reinforce-whiten-pop", reinforce, scope="batch", whiten=POPULATION,
    summary="the return, whitened with the population variance: OpenRLHF's gae (no critic) and reinforce"))
REGISTRY.register(Advantage(
    "drgrpo-whiten-pop", drgrpo, scope="batch", whiten=POPULATION,
    summary="R minus its group mean, then the KL, whitened with the population variance: OpenRLHF's "
            "reinforce_baseline, NeMo-RL's REINFORCE++ (minus_baseline)"))


def compute(name: str, rewards: Tensor, group_size: int, *, grpo_scale: bool = True) -> Tensor:
    """The advantages of estimator `name` over all the rows it reads, or a ValueError listing the choices
    (a whitening estimator's before the KL joins them and the whitening: `batch_advantages` does both)."""
    spec = REGISTRY[name]
    if spec.scaled:
        return spec.compute(rewards, group_size, scale=grpo_scale)
    return spec.compute(rewards, group_size)


def check_group_size(name: str, group_size: int, *, grpo_scale: bool = True) -> None:
    """A ValueError where estimator `name` cannot compute its advantages from groups of `group_size`:
    what a run config checks before any model loads."""
    spec = REGISTRY[name]
    if spec.paired and (grpo_scale or not spec.scaled):
        _check_pairs(name, group_size)
