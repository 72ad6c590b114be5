"""pass@1 of a model on a task's problems, sampled by a rollout engine and scored by the trainer's own
verifier: how hard a task is for a model before RL (the difficulty a study should train at, where the
model solves some problems but not most) and how a trained model does on held-out problems, with
none of lm-eval's machinery (a GPU machine may have the trainer alone).

A grid of task options (`--grid max_operand=9,20 --grid terms=2,3`) is measured with one engine, so
the model and the engine load once for the whole table.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from eval.verify import Verifier, last_boxed
from trainer.rollout.base import RolloutEngine, SamplingParams, sample_seeds
from trainer.tasks import Task, make_task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measurement:
    """pass@1 over `problems` problems x `samples` samples; `se` its standard error over problems."""

    options: dict[str, Any]
    problems: int
    samples: int
    pass_at_1: float
    se: float
    boxed: float        # share of responses with a complete \boxed{}
    stopped: float      # share of responses that ended (EOS or a stop string) within the token limit
    tokens: float       # mean response length
    seconds: float
    kl: float | None = None  # mean KL(pi || pi_ref) of a response (Rao-Blackwellized), when asked for

    def record(self) -> dict[str, Any]:
        return dict(self.__dict__)


def measure(engine: RolloutEngine, tokenizer, task: Task, options: dict[str, Any], problems: int,
            params: SamplingParams, seed: int, chat: bool, verifier: Verifier, batch: int = 64,
            kl_between: tuple[Any, Any] | None = None) -> Measurement:
    """`params.n` samples of problems 0..problems-1 of `task`, `batch` problems per generate(); with
    `kl_between` (the sampling policy's LM and a reference LM, on one device), also the responses' mean
    KL(pi || pi_ref) (trainer.measure.objective.sequence_kl)."""
    t0 = time.perf_counter()
    per_problem, texts, tokens, stops, kls = [], [], 0, 0, []
    for start in range(0, problems, batch):
        chosen = [task.problem(i) for i in range(start, min(problems, start + batch))]
        rollouts = engine.generate(task.prompt_ids(chosen, tokenizer, chat), params,
                                   sample_seeds(seed, start, len(chosen)))
        rewards = task.reward(rollouts.texts, [p for p in chosen for _ in range(params.n)], verifier)
        per_problem += [sum(rewards[i:i + params.n]) / params.n for i in range(0, len(rewards), params.n)]
        texts += rollouts.texts
        tokens += sum(len(t) for t in rollouts.token_ids)
        stops += sum(reason == "stop" for reason in rollouts.finish_reasons)
        if kl_between is not None:
            kls += _sequence_kl(kl_between, rollouts, tokenizer.pad_token_id, params)
    mean = sum(per_problem) / problems
    variance = sum((x - mean) ** 2 for x in per_problem) / max(1, problems - 1)
    return Measurement(options, problems, params.n, mean, math.sqrt(variance / problems),
                       sum(last_boxed(t) is not None for t in texts) / len(texts), stops / len(texts),
                       tokens / len(texts), time.perf_counter() - t0, sum(kls) / len(kls) if kls else None)


def _sequence_kl(models: tuple[Any, Any], rollouts, pad_id: int, params: SamplingParams) -> list[float]:
    from trainer.measure.objective import sequence_kl
    from trainer.model.logprobs import CompletionLogprobs

    policy, reference = (CompletionLogprobs(lm, params.temperature) for lm in models)
    device = next(models[0].parameters()).device
    return sequence_kl(policy, reference, rollouts, pad_id, device, params.max_new_tokens)


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """`KEY=V1,V2,...` strings (values read as YAML) as {KEY: [V1, V2, ...]}."""
    import yaml

    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--grid {item!r}: expected KEY=V1,V2,...")
        grid[key] = [yaml.safe_load(value) for value in values.split(",")]
    return grid


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's option values, the first option varying slowest."""
    names = list(grid)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())]


def table_markdown(task: str, rows: list[Measurement]) -> str:
    """The measurements as a Markdown table: the grid's options, then pass@1 and what explains it."""
    varied = [k for k in rows[0].options if len({json.dumps(r.options[k]) for r in rows}) > 1] or list(rows[0].options)
    lines = [f"| {' | '.join(varied)} | pass@1 | ± se | \\boxed{{}} | ended | tokens |",
             "|" + "---:|" * (len(varied) + 5)]
    for r in rows:
        cells = [str(r.options[k]) for k in varied]
        lines.append(f"| {' | '.join(cells)} | {r.pass_at_1:.3f} | {r.se:.3f} | {r.boxed:.2f} | {r.stopped:.2f} | "
                     f"{r.tokens:.0f} |")
    return f"{task}, {rows[0].problems} problems x {rows[0].samples} samples\n\n" + "\n".join(lines)


def run(model: str, task_name: str, base_options: dict[str, Any], grid: dict[str, list[Any]], problems: int,
        params: SamplingParams, seed: int, chat: bool, engine_name: str, device: str, dtype: str
        ) -> list[Measurement]:
    """Load the model and an engine once, then measure every grid point."""
    from trainer import config as run_config
    from trainer.distributed import World, full_parameters
    from trainer.model.models import load_model, load_tokenizer
    from trainer.rollout import make_engine

    config = run_config.load(None, [f"model.path={model}", f"model.device={device}", f"model.dtype={dtype}",
                                    f"rollout.engine={engine_name}", "rollout.vllm_sleep=false",
                                    f"rollout.max_new_tokens={params.max_new_tokens}"])
    tasks = [(options, make_task(task_name, {**base_options, **options})) for options in grid_points(grid)]
    tokenizer = load_tokenizer(model)
    lm = load_model(model, dtype, device).eval()
    engine = make_engine(config, lm, tokenizer, World(), weights=lambda: full_parameters(lm))
    verifier = Verifier()
    rows = []
    try:
        for options, task in tasks:
            rows.append(measure(engine, tokenizer, task, options, problems, params, seed, chat, verifier))
            log.info("%s %s: pass@1 %.3f ± %.3f", task_name, options, rows[-1].pass_at_1, rows[-1].se)
    finally:
        verifier.close()
        engine.close()
    return rows
