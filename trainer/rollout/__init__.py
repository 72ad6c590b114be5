"""Generation engines behind one interface (trainer.rollout.base.RolloutEngine): hf, vllm."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from trainer.batch import Rollouts
from trainer.rollout.base import RolloutEngine, SamplingParams

if TYPE_CHECKING:
    import torch

    from trainer.config import RunConfig
    from trainer.distributed import World

__all__ = ["RolloutEngine", "Rollouts", "SamplingParams", "make_engine"]

Weights = Callable[[], Iterable[tuple[str, "torch.Tensor"]]]


def make_engine(config: RunConfig, model, tokenizer, world: World, weights: Weights) -> RolloutEngine:
    """The engine `config.rollout.engine` names.

    model    hf: the trainer's own LM in one process, or a replica of it when the trainer's is
             sharded; vllm: the trainer's LM, whose parameter names `weights` carries (vLLM loads
             its own copy from config.model.path)
    weights  the trainer's current parameters, whole, by name: what sync_weights loads into an
             engine that holds its own copy
    """
    engine = config.rollout.engine
    if engine == "hf":
        from trainer.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, weights if world.sharded else None, config.rollout.hf_decoding)
    if engine == "vllm":
        from trainer.rollout.vllm import VLLMEngine

        # trained in float32 under bf16 mixed precision: vLLM generates in bf16 as the trainer computes
        dtype = "bfloat16" if config.train.mixed_precision == "bf16" else config.model.dtype
        return VLLMEngine(config.model.path, model, tokenizer, config.rollout, world, weights, dtype, config.train.seed)
    raise ValueError(f"rollout.engine: {engine!r} is not one of hf, vllm")
