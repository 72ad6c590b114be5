"""The three models a run holds (policy, reference, original reference): built, resumed, sharded, and their
log-prob passes under the run's precision. Every forward pass of a step goes through here."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from trainer import checkpoint
from trainer.batch import HeadInputs, PackedBatch
from trainer.config import RunConfig
from trainer.distributed import World, shard
from trainer.model.dropout import disable_dropout
from trainer.model.logprobs import CompletionLogprobs
from trainer.model.models import load_model
from trainer.objective import entropy_bonus, full_kl


def _checkpoint_activations(lm) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant, as FSDP2 needs)."""
    enable = getattr(lm, "activation_checkpointing_enable", None)  # transformers 5's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Policies:
    """policy       the trained model (`lm`, wrapped to give log-probs of completions)
    reference       the KL's reference: the initial weights, also on resume (moves when refreshed)
    original_reference  the reference the measured objective is taken against (the reference itself
                    unless a refreshed reference moves away from it)
    resumed         (step, trainer state) of the newest checkpoint, whose weights the policy now holds,
                    or None: read before sharding, so that every process reads it"""

    def __init__(self, config: RunConfig, world: World, checkpoints: Path) -> None:
        c = config
        self.config, self.world = config, world
        lm = load_model(c.model.path, c.model.dtype, world.device(c.model.device))
        disable_dropout(lm)  # trained in train mode, without its noise (so are the copies below)
        reference = copy.deepcopy(lm).eval().requires_grad_(False)  # the initial weights, also on resume
        # a refreshed reference moves: the measured objective stays that of the original one
        original = copy.deepcopy(reference) if c.objective.ref_refresh_every and c.measure.prompts else None
        self.replica = copy.deepcopy(lm).eval() if world.sharded and c.rollout.engine == "hf" else None
        self.resumed = checkpoint.load_latest(checkpoints, lm)  # before sharding: every process reads it
        if c.train.gradient_checkpointing:
            _checkpoint_activations(lm)
        self.lm = lm.train()
        self.policy = CompletionLogprobs(lm, c.rollout.temperature, c.train.logprob_chunk)
        self.reference = CompletionLogprobs(reference, c.rollout.temperature, c.train.logprob_chunk)
        self.original_reference = self.reference if original is None else CompletionLogprobs(
            original, c.rollout.temperature, c.train.logprob_chunk)
        bf16 = torch.bfloat16 if c.train.mixed_precision == "bf16" else None
        if world.sharded:
            shard(self.policy, lm, bf16)
            shard(self.reference, reference, bf16)
            if original is not None:
                shard(self.original_reference, original, bf16)
        self.autocast_dtype = bf16 if not world.sharded else None
        self.device = next(lm.parameters()).device

    @property
    def engine_model(self):
        """The model the engine is given: a replica when the policy is sharded, else the policy itself."""
        return self.replica if self.replica is not None else self.lm

    def precision(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def sampling_precision(self):
        """Under bf16 mixed precision the hf engine samples in bf16 too, as the trainer computes (vLLM is
        given the dtype instead): float32 sampling made the sampler another policy than the trained one."""
        if self.config.train.mixed_precision != "bf16" or self.config.rollout.engine != "hf":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def logprobs(self, model: CompletionLogprobs, batch: PackedBatch, with_entropy: bool = False):
        with self.precision():
            return model(batch, with_entropy)

    def reference_pass(self, batch: PackedBatch, full: bool) -> tuple[torch.Tensor, HeadInputs | None]:
        """The reference's log-probs of the sampled tokens and, with `full`, its completion states (what the
        exact KL is computed against), from one pass without gradient."""
        with torch.no_grad(), self.precision():
            if not full:
                return self.reference(batch)[0], None
            reference, sharded = self.reference, self.world.sharded
            states = reference.in_forward(lambda: reference.completion_states(batch, keep=sharded))
            return reference.logprobs_from_states(batch, states)[0], states

    def sampled_logprobs(self, batch: PackedBatch, with_entropy: bool = False,
                         reference: HeadInputs | None = None, entropy_grad: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The policy's log-probs of the sampled tokens; given the `reference`'s completion states of the
        batch, its exact KL to the reference at each position (else None); with `with_entropy`, each
        position's entropy (else None; with `entropy_grad`, always, with its gradient). [B, T] each."""
        policy = self.policy
        if entropy_grad:
            with self.precision():
                return policy.in_forward(lambda: entropy_bonus.logprobs_with_entropy(policy, batch, reference))
        if reference is None:
            logp, entropy = self.logprobs(policy, batch, with_entropy)
            return logp, None, entropy
        with self.precision():
            logp, entropy, token_kl = policy.in_forward(
                lambda: full_kl.logprobs_with_token_kl(policy, batch, reference, with_entropy))
        return logp, token_kl, entropy
