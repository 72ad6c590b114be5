"""Generation engines behind one interface (trainer.rollout.base.RolloutEngine): hf, vllm."""

from __future__ import annotations

from trainer.rollout.base import RolloutEngine, Rollouts, SamplingParams

__all__ = ["RolloutEngine", "Rollouts", "SamplingParams", "make_engine"]


def make_engine(name: str, model, tokenizer) -> RolloutEngine:
    """The engine called `name` over the trainer's model and tokenizer."""
    if name == "hf":
        from trainer.rollout.hf import HFEngine

        return HFEngine(model, tokenizer)
    if name == "vllm":
        raise ValueError("rollout.engine: vllm is not available yet (it comes with the GPU path); use hf")
    raise ValueError(f"rollout.engine: {name!r} is not one of hf, vllm")
