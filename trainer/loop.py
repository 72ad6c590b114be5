"""The RL training loop: rollouts, rewards, update, metrics, checkpoints, resume.

`train(config, out_dir)` runs (or resumes, or skips if finished) one run. The run directory holds
config.yaml, metrics.jsonl (one line per step), checkpoints/step_N/, final/ (an HF model directory
with the tokenizer) and COMPLETE. SIGTERM makes the run checkpoint after the current step and exit
with EXIT_PREEMPTED, so that a scheduler can requeue it and the same command resumes it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from eval.verify import Verifier
from trainer import checkpoint
from trainer.config import ConfigError, RunConfig
from trainer.logprobs import PackedBatch, completion_logprobs, pack
from trainer.models import load_model, load_tokenizer, resolve, save_pretrained_atomic
from trainer.objective import compute_loss
from trainer.progress import progress_bar
from trainer.rollout import make_engine
from trainer.rollout.base import Rollouts, SamplingParams
from trainer.run_files import COMPLETE, CONFIG, METRICS, read_metrics
from trainer.tasks import DataOrder, Task, make_task

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on SIGTERM; run the same command again to resume
TIMING_KEYS = ("step_time", "gen_time", "train_time", "tokens_per_s")  # the only non-reproducible metrics


class TrainingError(RuntimeError):
    """A run that cannot go on (for example too many non-finite updates in a row)."""


class Preempted(Exception):
    """Raised after the checkpoint that SIGTERM asked for has been written."""


@dataclass
class PendingBatch:
    """Rollouts generated ahead of the step that trains on them (async_level > 0)."""

    policy_step: int
    rollouts: Rollouts
    rewards: list[float]


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


class _SigtermFlag:
    """Records SIGTERM instead of dying, so the loop can checkpoint first."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: Any = None

    def __enter__(self) -> "_SigtermFlag":
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM received: checkpointing after this step, then exiting with %d", EXIT_PREEMPTED)
        self.raised = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def check_before_loading(config: RunConfig) -> Task:
    """Everything that can be checked before a model loads: the model's location and the data."""
    try:
        resolve(config.model.path)
    except ValueError as error:
        raise ConfigError(f"model.path: {error}") from None
    return make_task(config.task.name, config.task.options)


class Run:
    """One training run in `out_dir`; `train()` is the entry point."""

    def __init__(self, config: RunConfig, out_dir: Path) -> None:
        self.config, self.out = config, Path(out_dir)
        self.task = check_before_loading(config)
        self._claim_directory()
        c = config
        self.tokenizer = load_tokenizer(c.model.path)
        self.policy = load_model(c.model.path, c.model.dtype, c.model.device)
        self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.policy.train()
        self.device = next(self.policy.parameters()).device
        self.engine = make_engine(c.rollout.engine, self.policy, self.tokenizer)
        self.params = SamplingParams(n=c.train.group_size, temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                                     max_new_tokens=c.rollout.max_new_tokens, stop=tuple(c.rollout.stop))
        self.optimizer = _adamw(self.policy, c)
        total_updates = c.train.steps * c.train.minibatches * c.train.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(c, total_updates))
        self.order = DataOrder(len(self.task), c.train.seed)
        self.verifier = Verifier(timeout=c.verifier.timeout, workers=c.verifier.workers)
        self.sampler = torch.Generator().manual_seed(c.train.seed)
        self.step, self.data_position, self.nonfinite_in_row = 0, 0, 0
        self.pending: deque[PendingBatch] = deque()
        torch.manual_seed(c.train.seed)
        np.random.seed(c.train.seed)
        random.seed(c.train.seed)

    # --- run directory ----------------------------------------------------------------------

    def _claim_directory(self) -> None:
        """Write config.yaml, or check that a run already here was started with the same config."""
        self.out.mkdir(parents=True, exist_ok=True)
        config_file = self.out / CONFIG
        wanted = self.config.to_dict()
        if config_file.exists():
            existing = yaml.safe_load(config_file.read_text())
            if existing != wanted:
                changed = sorted(f"{s}.{k}" for s in wanted for k in set(wanted[s]) | set(existing.get(s, {}))
                                 if wanted[s].get(k) != existing.get(s, {}).get(k))
                raise ConfigError(f"--out {self.out} holds a run with a different config ({', '.join(changed)}); "
                                  "use another --out, or the same config to resume it")
        else:
            config_file.write_text(yaml.safe_dump(wanted, sort_keys=False))

    @property
    def checkpoints_dir(self) -> Path:
        return self.out / "checkpoints"

    # --- state ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step, "data_position": self.data_position, "nonfinite_in_row": self.nonfinite_in_row,
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.get_state(), "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(), "python_rng": random.getstate(),
            "pending": [{"policy_step": p.policy_step, "rollouts": p.rollouts.to_state(), "rewards": p.rewards}
                        for p in self.pending],
            "verifier_counts": dict(self.verifier.counts),
        }

    def restore(self) -> None:
        loaded = checkpoint.load_latest(self.checkpoints_dir, self.policy)
        if loaded is None:
            return
        step, state = loaded
        self.step, self.data_position = state["step"], state["data_position"]
        self.nonfinite_in_row = state["nonfinite_in_row"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.set_state(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["python_rng"])
        self.pending = deque(PendingBatch(p["policy_step"], Rollouts.from_state(p["rollouts"]), p["rewards"])
                             for p in state["pending"])
        self.verifier.counts.update(state["verifier_counts"])
        self._truncate_metrics(step)
        log.info("resumed from checkpoint step_%d", step)

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics of steps after the checkpoint (and a torn last line): they are run again."""
        path = self.out / METRICS
        if path.exists():
            kept = [line for line in read_metrics(path) if line["step"] < step]
            path.write_text("".join(json.dumps(line) + "\n" for line in kept))

    def save_checkpoint(self) -> None:
        self.engine.sync_weights()
        c = self.config.checkpoint
        checkpoint.save(self.checkpoints_dir, self.step, self.policy, self.state(), c.keep, c.keep_every,
                        self.tokenizer)

    # --- one step ---------------------------------------------------------------------------

    def _encode_prompts(self, indices: list[int]) -> tuple[list[list[int]], list]:
        chat = self.config.model.chat_template
        problems = [self.task.problem(i) for i in indices]
        texts = [self.task.prompt(p, self.tokenizer, chat) for p in problems]
        ids = [self.tokenizer(t, add_special_tokens=not chat)["input_ids"] for t in texts]
        return ids, problems

    def _generate(self) -> PendingBatch:
        count = self.config.train.prompts_per_step
        indices = self.order.take(self.data_position, count)
        self.data_position += count
        prompt_ids, problems = self._encode_prompts(indices)
        rollouts = self.engine.generate(prompt_ids, self.params, self.sampler)
        if self.config.rollout.recompute_logprobs:
            with torch.no_grad():
                batch = pack(rollouts, self.tokenizer.pad_token_id).to(self.device)
                logp, _ = self._logprobs(self.policy, batch)
            rollouts.logprobs = [row[: len(t)].tolist() for row, t in zip(logp.cpu(), rollouts.token_ids, strict=True)]
        expanded = [p for p in problems for _ in range(self.params.n)]
        rewards = self.task.reward(rollouts.texts, expanded, self.verifier)
        return PendingBatch(self.step, rollouts, rewards)

    def _logprobs(self, model, batch: PackedBatch, with_entropy: bool = False):
        return completion_logprobs(model, batch, self.params.temperature, with_entropy, self.config.train.logprob_chunk)

    def _update(self, batch: PackedBatch, rewards: torch.Tensor, ref_logp: torch.Tensor,
                old_logp: torch.Tensor | None, with_entropy: bool) -> dict[str, float]:
        """One optimizer update on `batch` (whole groups); skipped if anything is non-finite."""
        c = self.config
        logp, entropy = self._logprobs(self.policy, batch, with_entropy)
        loss, stats = compute_loss(logp, ref_logp, old_logp, rewards, batch.completion_mask, c.train.group_size,
                                   c.objective)
        self.optimizer.zero_grad(set_to_none=True)
        grad_norm = float("nan")
        if torch.isfinite(loss):
            loss.backward()
            max_norm = c.train.grad_clip if c.train.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm))
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_row += 1
            log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                        self.step, self.nonfinite_in_row)
            if self.nonfinite_in_row >= c.train.max_nonfinite_updates:
                raise TrainingError(f"{self.nonfinite_in_row} non-finite updates in a row at step {self.step} "
                                    "(train.max_nonfinite_updates): lower train.lr or check the model's dtype")
        else:
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts updates made, not updates skipped
            self.nonfinite_in_row = 0
        stats.update(loss=float(loss.detach()), grad_norm=grad_norm, skipped_updates=float(skipped))
        if entropy is not None:
            mask = batch.completion_mask
            stats["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        return stats

    def run_step(self) -> dict[str, Any]:
        c, t0 = self.config, time.perf_counter()
        while len(self.pending) <= c.train.async_level:
            self.pending.append(self._generate())
        entry = self.pending.popleft()
        t_gen = time.perf_counter()
        batch = pack(entry.rollouts, self.tokenizer.pad_token_id).to(self.device)
        rewards = torch.tensor(entry.rewards, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            ref_logp, _ = self._logprobs(self.reference, batch)
        exactly_on_policy = c.train.async_level == 0 and c.train.minibatches == 1 and c.train.epochs == 1
        old_logp = None if exactly_on_policy else batch.behaviour_logp
        rows = len(entry.rollouts) // c.train.minibatches
        updates: list[dict[str, float]] = []
        for epoch in range(c.train.epochs):
            for start in range(0, len(entry.rollouts), rows):
                part = slice(start, start + rows)
                updates.append(self._update(batch.rows(part), rewards[part], ref_logp[part],
                                            None if old_logp is None else old_logp[part], epoch == 0))
        self.engine.sync_weights()
        t_end = time.perf_counter()
        metrics = self._metrics(entry, batch, updates, t0, t_gen, t_end)
        self.step += 1
        return metrics

    def _metrics(self, entry: PendingBatch, batch: PackedBatch, updates: list[dict[str, float]],
                 t0: float, t_gen: float, t_end: float) -> dict[str, Any]:
        first_epoch = updates[: self.config.train.minibatches]
        averaged = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0] if k != "entropy"}
        averaged["entropy"] = sum(u["entropy"] for u in first_epoch) / len(first_epoch)
        averaged["skipped_updates"] = sum(u["skipped_updates"] for u in updates)
        rewards = entry.rewards
        generated = sum(len(t) for t in entry.rollouts.token_ids)
        trained = batch.tokens * self.config.train.epochs
        return {
            "step": self.step,
            "policy_step": entry.policy_step,
            "reward_mean": sum(rewards) / len(rewards),
            "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
            **averaged,
            "lr": self.scheduler.get_last_lr()[0],
            "stop_frac": sum(f == "stop" for f in entry.rollouts.finish_reasons) / len(rewards),
            "verifier_timeouts": float(self.verifier.counts["timeouts"]),
            "verifier_errors": float(self.verifier.counts["errors"]),
            "verifier_rejected": float(self.verifier.counts["rejected"]),
            "generated_tokens": generated,
            "trained_tokens": trained,
            "gen_time": t_gen - t0,
            "train_time": t_end - t_gen,
            "step_time": t_end - t0,
            "tokens_per_s": (generated + trained) / max(t_end - t0, 1e-9),
        }

    # --- the whole run ----------------------------------------------------------------------

    def train(self, sigterm: _SigtermFlag) -> None:
        c = self.config
        self.restore()
        metrics_file = (self.out / METRICS).open("a")
        bar = progress_bar(c.train.steps, "train")
        bar.update(self.step)
        try:
            while self.step < c.train.steps:
                if sigterm.raised:
                    raise Preempted
                metrics = self.run_step()
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                bar.update()
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['kl_k3']:.4f}")
                if self.step % c.checkpoint.every == 0 or sigterm.raised:
                    self.save_checkpoint()
        except Preempted:
            if self.step and not (self.checkpoints_dir / f"step_{self.step}").exists():
                self.save_checkpoint()
            raise
        finally:
            bar.close()
            metrics_file.close()
            self.verifier.close()
        save_pretrained_atomic(self.out / "final", self.policy, self.tokenizer)
        (self.out / COMPLETE).write_text(json.dumps({"steps": self.step, "finished": time.time()}) + "\n")
        log.info("run complete: %s", self.out)


def train(config: RunConfig, out_dir: Path) -> int:
    """Run, resume or skip (if complete) the run in `out_dir`; the process exit status."""
    out_dir = Path(out_dir)
    if (out_dir / COMPLETE).exists():
        log.info("%s is already complete; nothing to do", out_dir)
        return 0
    with _SigtermFlag() as sigterm:  # from the start: a SIGTERM during loading also ends in a clean exit
        run = Run(config, out_dir)
        try:
            run.train(sigterm)
        except Preempted:
            log.warning("preempted at step %d; checkpoint written, exiting with %d", run.step, EXIT_PREEMPTED)
            return EXIT_PREEMPTED
    return 0
