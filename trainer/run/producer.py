"""The producer: the next steps' prompts sampled ahead (train.async_level), packed once, and scored.

What a step trains on is decided here, from the data position and per-prompt seeds alone, so that a resumed
run samples exactly what the uninterrupted one did."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from eval.verify import Verifier, VerifierUnavailable
from trainer.batch import HeadInputs, PackedBatch, Rollouts, pack
from trainer.config import RunConfig
from trainer.distributed import World
from trainer.rollout.base import SamplingParams, sample_seeds
from trainer.run.errors import TrainingError
from trainer.run.policies import Policies
from trainer.tasks import DataOrder, Task

log = logging.getLogger(__name__)


@dataclass
class PendingBatch:
    """Rollouts and their rewards, generated ahead of the step that trains on them when async_level > 0.

    trainer_logprobs  the trainer's log-probs of the sampled tokens under the policy that sampled
                      them (computed right after generation; None where the step's update computes
                      them in its first pass, `Producer.update_makes_trainer_logprobs`); rollouts.logprobs
                      are the engine's
    trainer_token_kl  the exact KL(pi || pi_ref) over the vocabulary at each sampled position, under
                      the policy that sampled (only where estimator full shapes the reward)
    reference         the reference's log-probs and completion states of the batch, from the pass that
                      trainer_token_kl needed: the step reuses them (kept in memory only; a resumed
                      run computes them again)
    packed            the rollouts as tensors on the device, packed once after generation (kept in memory
                      only; a resumed run packs them again, to the same tensors)
    """

    policy_step: int
    rollouts: Rollouts
    rewards: list[float]
    trainer_logprobs: list[list[float]] | None
    trainer_token_kl: list[list[float]] | None = None
    reference: tuple[torch.Tensor, HeadInputs] | None = field(default=None, repr=False)
    packed: PackedBatch | None = field(default=None, repr=False)

    def to_state(self) -> dict[str, Any]:
        return {"policy_step": self.policy_step, "rollouts": self.rollouts.to_state(), "rewards": self.rewards,
                "trainer_logprobs": self.trainer_logprobs, "trainer_token_kl": self.trainer_token_kl}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PendingBatch":
        rollouts = Rollouts.from_state(state["rollouts"])
        trainer_logprobs = state.get("trainer_logprobs")
        if trainer_logprobs is None:  # a checkpoint from before they were kept: the engine's stand in
            log.warning("a pending batch of the checkpoint has no trainer log-probs; the engine's stand in for them")
            trainer_logprobs = rollouts.logprobs
        return cls(state["policy_step"], rollouts, state["rewards"], trainer_logprobs, state.get("trainer_token_kl"))


class Producer:
    """Generates this process's share of each step's prompts, `async_level` steps ahead of training."""

    def __init__(self, config: RunConfig, task: Task, tokenizer, world: World, policies: Policies, engine,
                 verifier: Verifier) -> None:
        c = config
        self.config, self.task, self.tokenizer, self.world = config, task, tokenizer, world
        self.policies, self.engine, self.verifier = policies, engine, verifier
        self.params = SamplingParams(n=c.train.group_size, temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                                     max_new_tokens=c.rollout.max_new_tokens, stop=tuple(c.rollout.stop))
        self.order = DataOrder(len(task), c.train.seed)
        self.pending: deque[PendingBatch] = deque()

    def next(self, state) -> PendingBatch:
        """The batch the step `state.step` trains on, after generating as far ahead as async_level asks."""
        while len(self.pending) <= self.config.train.async_level:
            self.pending.append(self.generate(state))
        return self.pending.popleft()

    def encode_prompts(self, indices: list[int]) -> tuple[list[list[int]], list]:
        chat = self.config.model.chat_template
        problems = [self.task.problem(i) for i in indices]
        return self.task.prompt_ids(problems, self.tokenizer, chat), problems

    def generate(self, state) -> PendingBatch:
        """This process's share of the next step's prompts, sampled, and their rewards."""
        t, policies = self.config.train, self.policies
        indices = self.order.take(state.data_position, t.prompts_per_step)
        seeds = sample_seeds(t.seed, state.data_position, t.prompts_per_step)
        state.data_position += t.prompts_per_step
        indices, seeds = zip(*self.world.my_share(list(zip(indices, seeds, strict=True)), t.minibatches), strict=True)
        prompt_ids, problems = self.encode_prompts(list(indices))
        with policies.sampling_precision():
            rollouts = self.engine.generate(prompt_ids, self.params, list(seeds))
        packed = pack(rollouts, self.tokenizer.pad_token_id).to(policies.device)
        objective = self.config.objective
        reference = None
        if objective.needs_full_kl and objective.kl_in_reward:  # the sampler's exact KL, for the reward
            reference = policies.reference_pass(packed, full=True)
        logp = token_kl = None
        if not self.update_makes_trainer_logprobs():  # the policy that just sampled, as the trainer computes it
            with torch.no_grad():
                states = None if reference is None else reference[1]
                logp, token_kl, _ = policies.sampled_logprobs(packed, reference=states)

        def ragged(values: torch.Tensor) -> list[list[float]]:
            return [row[: len(tokens)].tolist() for row, tokens in zip(values.cpu(), rollouts.token_ids, strict=True)]

        expanded = [p for p in problems for _ in range(self.params.n)]
        try:
            rewards = self.task.reward(rollouts.texts, expanded, self.verifier)
        except VerifierUnavailable as error:
            raise TrainingError(str(error)) from None
        return PendingBatch(state.step, rollouts, rewards, None if logp is None else ragged(logp),
                            None if token_kl is None else ragged(token_kl), reference, packed)

    def update_makes_trainer_logprobs(self) -> bool:
        """Whether the step's one update computes the trainer's log-probs of the samples in its first forward
        pass, over the whole batch, before the weights change (on-policy, one update, one micro-batch), and no
        KL in the reward needs them before it: then that pass stands in for one of their own after generation
        (the same computation on the same weights: the same numbers)."""
        t = self.config.train
        rows = t.prompts_per_step // self.world.size * t.group_size
        return (t.async_level == 0 and t.minibatches == 1 and t.epochs == 1 and t.micro_batch_size in (0, rows)
                and not self.config.objective.kl_in_reward)
