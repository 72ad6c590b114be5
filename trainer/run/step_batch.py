"""A step's data from the rollouts to the loss, on the device (`StepBatch`), and how a step makes it from a
pending batch: packed once, the reference's pass, the sampler's KL in the reward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.batch import HeadInputs, PackedBatch, completion_counts, pack, states_of_rows, token_matrix
from trainer.config import RunConfig
from trainer.objective.kl_terms import reward_kl
from trainer.objective.objective_config import ObjectiveConfig
from trainer.run.policies import Policies
from trainer.run.producer import PendingBatch


def _rows(tensor: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[part]


@dataclass
class StepBatch:
    """A step's data, from the rollouts to the loss. [B, T] tensors of this process's rows, except rewards [B].

    entry         the step's pending batch, whole (also in the rows of a part)
    trainer_logp  the trainer's log-probs of the samples under the policy that sampled them, or None where
                  the update's first pass makes them (`Producer.update_makes_trainer_logprobs`)
    old_logp      the behaviour policy of the importance ratio, or None exactly on policy
    sampler_kl    each response's KL in the reward, under the sampler (None without a KL in the reward)
    state_counts  each row's completion tokens, where `ref_states` holds them (read from the device once a step)
    """

    entry: PendingBatch
    batch: PackedBatch
    rewards: torch.Tensor
    ref_logp: torch.Tensor
    ref_states: HeadInputs | None
    engine_logp: torch.Tensor
    trainer_logp: torch.Tensor | None
    old_logp: torch.Tensor | None
    sampler_kl: torch.Tensor | None
    state_counts: list[int] | None = None

    def rows(self, part: slice) -> "StepBatch":
        """The rows `part` (a slice with a step of 1): a minibatch of the step, or a micro-batch of one."""
        states = counts = None
        if self.ref_states is not None:
            states, counts = states_of_rows(self.ref_states, self.state_counts, part), self.state_counts[part]
        return StepBatch(self.entry, self.batch.rows(part), self.rewards[part], self.ref_logp[part], states,
                         self.engine_logp[part], _rows(self.trainer_logp, part), _rows(self.old_logp, part),
                         _rows(self.sampler_kl, part), counts)


def step_batch(entry: PendingBatch, policies: Policies, config: RunConfig, objective: ObjectiveConfig,
               pad_id: int) -> StepBatch:
    """The step's batch on the device: packed (once), the reference's pass, the sampler's KL in the reward."""
    c, device = config, policies.device
    batch = entry.packed if entry.packed is not None else pack(entry.rollouts, pad_id).to(device)
    rewards = torch.tensor(entry.rewards, dtype=torch.float32, device=device)
    ref_logp, ref_states = entry.reference or policies.reference_pass(batch, full=c.objective.needs_full_kl)
    engine_logp = batch.behaviour_logp
    trainer_logp = None
    if entry.trainer_logprobs is not None:
        trainer_logp = token_matrix(entry.trainer_logprobs, engine_logp.shape[1]).to(device)
    # the behaviour policy as the trainer sees it: its own log-probs where it recomputes them or
    # corrects the engine with TIS (which then weights by trainer / engine), else the engine's
    tis = c.objective.tis_cap is not None
    behaviour = trainer_logp if c.rollout.recompute_logprobs or tis else engine_logp
    exactly_on_policy = c.train.async_level == 0 and c.train.minibatches == 1 and c.train.epochs == 1
    sampler_kl = None
    if c.objective.kl_in_reward:  # the sampler's, once per batch
        token_kl = None if entry.trainer_token_kl is None else token_matrix(entry.trainer_token_kl,
                                                                           trainer_logp.shape[1]).to(device)
        sampler_kl = reward_kl(objective, trainer_logp, ref_logp, batch.completion_mask, token_kl)
    return StepBatch(entry, batch, rewards, ref_logp, ref_states, engine_logp, trainer_logp,
                     None if exactly_on_policy else behaviour, sampler_kl,
                     None if ref_states is None else completion_counts(batch))
