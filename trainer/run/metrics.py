"""One line of metrics.jsonl, from a step's batch and updates, summed over the processes: what the run
reports lives apart from what it computes."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from trainer.config import TrainConfig
from trainer.distributed import World
from trainer.run.state import TrainState
from trainer.run.step_batch import StepBatch


class StepTimes(NamedTuple):
    """When the step started, when its rollouts were ready and when it ended (perf_counter seconds)."""

    start: float
    generated: float
    end: float


def _log_ratio(logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi / mu_engine) of each sampled token in float64, 0 where `mask` is."""
    return (logp.double() - engine_logp.double()) * mask


def mismatch_sums(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs of sampled tokens are from the trainer's, as sums over tokens
    (so that processes add up): |delta log p| and k3 = r - 1 - log r with r = pi_trainer / mu_engine,
    whose mean estimates KL(mu_engine || pi_trainer) per token from the engine's samples (>= 0)."""
    log_ratio = _log_ratio(trainer_logp, engine_logp, mask)
    k3 = (torch.expm1(log_ratio) - log_ratio) * mask  # expm1 in float64: no rounding below 0 near r = 1
    return {"abs_sum": float(log_ratio.abs().sum()), "abs_max": float(log_ratio.abs().max()),  # pack: >= 1 column
            "k3_sum": float(k3.sum()), "tokens": float(mask.sum())}


def _shifted(log_weights: torch.Tensor) -> tuple[float, float, float, float]:
    """(max, sum of w / e^max, sum of w^2 / e^(2 max), count) of the weights e^log_weights: parts that add up
    over processes without overflow."""
    if not log_weights.numel():
        return (0.0, 0.0, 0.0, 0.0)
    top = log_weights.max()
    shifted = log_weights - top
    return (float(top), float(shifted.exp().sum()), float((2 * shifted).exp().sum()), float(log_weights.numel()))


def importance_parts(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor
                     ) -> dict[str, tuple[float, float, float, float]]:
    """The importance weights w = pi_trainer / mu_engine of the sampled tokens ("token") and of whole
    completions ("sequence", the product of their tokens' weights), as parts that processes add up
    (effective_sample_size)."""
    log_ratio = _log_ratio(trainer_logp, engine_logp, mask)
    rows = mask.sum(dim=1) > 0
    return {"token": _shifted(log_ratio[mask.bool()]), "sequence": _shifted(log_ratio.sum(dim=1)[rows])}


def effective_sample_size(parts: list[tuple[float, float, float, float]]) -> float:
    """The normalized effective sample size (sum w)^2 / (n sum w^2) of the weights whose parts (one per
    process) are given: 1 when every weight is equal, 1/n when one carries them all; 1 with no weight."""
    counted = [p for p in parts if p[3]]
    if not counted:
        return 1.0
    top = max(p[0] for p in counted)
    total = sum(p[1] * math.exp(p[0] - top) for p in counted)
    squares = sum(p[2] * math.exp(2 * (p[0] - top)) for p in counted)
    return total * total / (sum(p[3] for p in counted) * squares)


def step_metrics(sb: StepBatch, updates: list[dict[str, float]], mismatch: dict[str, float], state: TrainState,
                 train: TrainConfig, world: World, verifier_counts: dict[str, int], times: StepTimes,
                 weights: dict[str, tuple[float, float, float, float]]) -> dict[str, Any]:
    """One line of metrics.jsonl: the updates' statistics (already over every process) and the
    step's rewards, lengths, counts, engine mismatch and importance weights summed over the processes."""
    entry = sb.entry
    t0, t_gen, t_end = times
    first_epoch = updates[: train.minibatches]
    averaged = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0] if k != "entropy"}
    averaged["entropy"] = sum(u["entropy"] for u in first_epoch) / len(first_epoch)
    averaged["skipped_updates"] = sum(u["skipped_updates"] for u in updates)
    processes = world.gather({
        "rewards": entry.rewards, "stops": sum(f == "stop" for f in entry.rollouts.finish_reasons),
        "generated": sum(len(t) for t in entry.rollouts.token_ids), "trained": sb.batch.tokens,
        "verifier": dict(verifier_counts), "mismatch": mismatch, "weights": weights})
    rewards = [r for p in processes for r in p["rewards"]]
    generated = sum(p["generated"] for p in processes)
    trained = sum(p["trained"] for p in processes) * train.epochs
    verifier = {k: float(sum(p["verifier"].get(k, 0) for p in processes))
                for k in ("timeouts", "errors", "rejected")}
    mismatch_tokens = max(1.0, sum(p["mismatch"]["tokens"] for p in processes))
    return {
        "step": state.step,
        "policy_step": entry.policy_step,
        "reward_mean": sum(rewards) / len(rewards),
        "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
        **averaged,
        "lr": state.scheduler.get_last_lr()[0],
        "stop_frac": sum(p["stops"] for p in processes) / len(rewards),
        "mismatch_logp_mean": sum(p["mismatch"]["abs_sum"] for p in processes) / mismatch_tokens,
        "mismatch_logp_max": max(p["mismatch"]["abs_max"] for p in processes),
        "mismatch_kl": sum(p["mismatch"]["k3_sum"] for p in processes) / mismatch_tokens,
        "ess": effective_sample_size([p["weights"]["token"] for p in processes]),
        "ess_seq": effective_sample_size([p["weights"]["sequence"] for p in processes]),
        "verifier_timeouts": verifier["timeouts"],
        "verifier_errors": verifier["errors"],
        "verifier_rejected": verifier["rejected"],
        "generated_tokens": generated,
        "trained_tokens": trained,
        "gen_time": t_gen - t0,
        "train_time": t_end - t_gen,
        "step_time": t_end - t0,
        "tokens_per_s": (generated + trained) / max(t_end - t0, 1e-9),
    }
