"""Supervised warm-up: teach a (toy) base model a task's answers so RL starts above zero reward."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from eval.verify import Verifier
from trainer.model.models import load_model, load_tokenizer, save_pretrained_atomic
from trainer.progress import progress_bar
from trainer.rollout.base import SamplingParams, sample_seeds
from trainer.rollout.hf import HFEngine
from trainer.tasks import DataOrder, make_task

log = logging.getLogger(__name__)


def _batch(tokenizer, task, problems, chat: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + target + EOS, with labels only on target and EOS."""
    rows, labels = [], []
    for problem in problems:
        prompt = task.prompt_ids([problem], tokenizer, chat)[0]
        target = tokenizer(task.target(problem), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    label_t = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, lab) in enumerate(zip(rows, labels, strict=True)):
        ids[i, :len(row)], label_t[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), torch.tensor(lab), 1
    return ids, mask, label_t


def sample_reward(model, tokenizer, task, problems, chat: bool, max_new_tokens: int, seed: int) -> float:
    """Mean reward of one temperature-1 sample per problem: where RL will start."""
    engine = HFEngine(model, tokenizer)
    prompts = task.prompt_ids(problems, tokenizer, chat)
    rollouts = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=max_new_tokens, stop=("\n",)),
                               sample_seeds(seed, 0, len(prompts)))
    verifier = Verifier()
    try:
        rewards = task.reward(rollouts.texts, problems, verifier)
    finally:
        verifier.close()
    return sum(rewards) / len(rewards)


def sft(model_path: str, task_name: str, out_dir: Path, task_options: dict[str, Any] | None = None,
        steps: int = 300, batch_size: int = 64, lr: float = 3e-3, warmup: int = 20, seed: int = 0,
        chat: bool = False, eval_problems: int = 128, max_new_tokens: int = 16) -> dict[str, float]:
    """Fine-tune on task answers for `steps` steps, save to `out_dir`, report loss and sampled reward."""
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"sft: need steps >= 1, batch size >= 1 and lr > 0; got {steps}, {batch_size}, {lr}")
    task = make_task(task_name, task_options)
    tokenizer = load_tokenizer(model_path)
    torch.manual_seed(seed)
    model = load_model(model_path)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    order = DataOrder(len(task), seed)
    bar = progress_bar(steps, "sft")
    loss_value = float("nan")
    for step in range(steps):
        problems = [task.problem(i) for i in order.take(step * batch_size, batch_size)]
        ids, mask, labels = _batch(tokenizer, task, problems, chat)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        bar.update()
        bar.set_postfix(loss=f"{loss_value:.3f}")
    bar.close()
    held_out = [task.problem(i) for i in order.take(steps * batch_size, eval_problems)]
    reward = sample_reward(model, tokenizer, task, held_out, chat, max_new_tokens, seed)
    report = {"final_loss": loss_value, "sampled_reward": reward, "steps": steps}
    save_pretrained_atomic(Path(out_dir), model, tokenizer, extra={"klstudy_sft.json": report})
    log.info("sft done: loss %.4f, sampled reward %.3f, model in %s", loss_value, reward, out_dir)
    return report
