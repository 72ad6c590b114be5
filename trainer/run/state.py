"""The train state: what a checkpoint holds besides the weights, as ONE plain dict, written and read back here
only. A field added to the run's state is added to `checkpoint_state` and `restore`, next to each other."""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eval.verify import Verifier
from trainer import checkpoint
from trainer.checkpoint_copies import holds_reference
from trainer.config import ConfigError, RunConfig
from trainer.distributed import World, full_optimizer_state, full_state_dict, load_full_state_dict, load_optimizer_state
from trainer.lease import Lease
from trainer.objective.kl_coefficient import KLCoefficient
from trainer.run import directory
from trainer.run.policies import Policies
from trainer.run.producer import PendingBatch, Producer

log = logging.getLogger(__name__)


def _schedule(config: RunConfig, total_updates: int):
    t = config.train

    def factor(update: int) -> float:
        if update < t.warmup_steps:
            return (update + 1) / (t.warmup_steps + 1)
        progress = (update - t.warmup_steps) / max(1, total_updates - t.warmup_steps)
        if t.lr_schedule == "linear":
            return max(0.0, 1 - progress)
        if t.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def _adamw(model, config: RunConfig) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for all parameters) where this torch supports it for these parameters."""
    t = config.train
    kwargs = dict(lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)
    try:
        return torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(model.parameters(), **kwargs)


@dataclass
class TrainState:
    """The counters and the optimizer's side of the run; `saved_step`: the step of the newest checkpoint."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    coefficient: KLCoefficient  # beta, adapted as the run trains (objective.kl_target)
    step: int = 0
    data_position: int = 0
    nonfinite_in_row: int = 0
    saved_step: int | None = None

    @classmethod
    def new(cls, config: RunConfig, policy: torch.nn.Module) -> "TrainState":
        c = config
        optimizer = _adamw(policy, c)
        total_updates = c.train.steps * c.train.minibatches * c.train.epochs
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(c, total_updates))
        return cls(optimizer, scheduler, KLCoefficient(c.objective))


def process_state(producer: Producer, verifier: Verifier) -> dict[str, Any]:
    """What differs between processes: random states, rollouts generated ahead, verifier counts."""
    return {
        "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(), "python_rng": random.getstate(),
        "pending": [p.to_state() for p in producer.pending],
        "verifier_counts": dict(verifier.counts),
    }


@dataclass(frozen=True)
class Checkpoints:
    """Where a run's checkpoints go and what is saved beside the weights: the run directory, the run config
    (checkpoint.*, and whether the reference moves), the tokenizer, the process group. `save` and
    `restore` take the parts whose state a checkpoint holds."""

    out: Path
    config: RunConfig
    world: World
    tokenizer: Any

    def state(self, train: TrainState, policies: Policies, producer: Producer, verifier: Verifier) -> dict[str, Any]:
        """The checkpoint's trainer state, every process joining in the gathers."""
        s = train
        state = {"step": s.step, "data_position": s.data_position, "nonfinite_in_row": s.nonfinite_in_row,
                 "kl_coefficient": s.coefficient.state_dict(),
                 "optimizer": full_optimizer_state(policies.policy, s.optimizer),
                 "scheduler": s.scheduler.state_dict(),
                 "processes": self.world.gather(process_state(producer, verifier))}
        if holds_reference(self.config):  # the reference moves: it is part of the run's state
            state["reference"] = full_state_dict(policies.reference, prefix="lm.")
        return state

    def save(self, train: TrainState, policies: Policies, producer: Producer, verifier: Verifier,
             lease: Lease | None) -> None:
        """Every process joins in gathering the weights and optimizer state; the main process writes."""
        c = self.config.checkpoint
        weights = full_state_dict(policies.policy, prefix="lm.")
        state = self.state(train, policies, producer, verifier)
        if self.world.main:
            lease.check()
            checkpoint.save(directory.checkpoints_dir(self.out), train.step, policies.lm, state, c.keep,
                            c.keep_every, self.tokenizer, state_dict=weights)
        self.world.barrier()
        train.saved_step = train.step

    def restore(self, train: TrainState, policies: Policies, producer: Producer, verifier: Verifier) -> None:
        """Continue from the checkpoint whose weights the policies loaded, if any. Without one the run starts
        over: lines that a run killed before its first checkpoint wrote are dropped."""
        world, resumed = self.world, policies.resumed
        if resumed is None:
            if world.main:
                directory.truncate_metrics(self.out, 0)
            return
        step, state = resumed
        s = train
        processes = state.get("processes") or [state]  # a checkpoint from before multi-process runs
        if len(processes) != world.size:
            raise ConfigError(f"{directory.checkpoints_dir(self.out)}/step_{step}",
                              f"was written by {len(processes)} training process(es); resume it with as many, "
                              f"not {world.size}")
        s.step, s.data_position = state["step"], state["data_position"]
        s.nonfinite_in_row = state["nonfinite_in_row"]
        if "kl_coefficient" in state:
            s.coefficient.load_state_dict(state["kl_coefficient"])
        if holds_reference(self.config):
            load_full_state_dict(policies.reference, state["reference"], prefix="lm.")
        load_optimizer_state(policies.policy, s.optimizer, state["optimizer"])
        s.scheduler.load_state_dict(state["scheduler"])
        mine = processes[world.rank]
        torch.set_rng_state(mine["torch_rng"])
        np.random.set_state(mine["numpy_rng"])
        random.setstate(mine["python_rng"])
        producer.pending = deque(PendingBatch.from_state(p) for p in mine["pending"])
        verifier.counts.update(mine["verifier_counts"])
        if world.main:
            directory.truncate_metrics(self.out, step)
        log.info("resumed from checkpoint step_%d", step)
