"""The options of `python -m eval run`, and the evaluations they ask for: one reading of a command line,
shared by the command itself and by a study (sweep.study.changes), which reads the very options its jobs get
to know what an evaluation would record."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eval.harness import EvalSettings


class UsageError(ValueError):
    """Options that do not pair up (a --out per --model): the message says how."""


@dataclass(frozen=True)
class Request:
    """One evaluation: its settings, where it goes, and the file that names its model (or None)."""

    settings: EvalSettings
    out: Path
    model_record: Path | None


def parser() -> argparse.ArgumentParser:
    from eval.suites import SUITES, TASKS

    top = argparse.ArgumentParser(prog="python -m eval", description="klstudy's evaluation (lm-eval tasks)")
    sub = top.add_subparsers(dest="command", required=True)
    suites = "; ".join(f"{name}: {' '.join(tasks)}" for name, tasks in SUITES.items())
    p = sub.add_parser("run", help="evaluate a model on suites or tasks",
                       description=f"Suites ({suites}). Tasks: {', '.join(TASKS)}.")
    p.add_argument("--model", required=True, action="append",
                   help="HF model directory (or hub id); repeat it, each with its own --out (and --seed), to "
                        "evaluate several models one after another in one process")
    p.add_argument("--suite", nargs="+", required=True, metavar="SUITE_OR_TASK", help="suites and/or task names")
    p.add_argument("--backend", default="hf", help="hf | vllm (default hf)")
    p.add_argument("--samples", type=int, default=1, help="samples per problem: pass@1 is their mean (default 1)")
    p.add_argument("--out", type=Path, required=True, action="append",
                   help="directory for metrics.json and samples.jsonl (one per --model); one that already "
                        "holds a metrics.json is a finished evaluation, left as it is")
    p.add_argument("--model-record", type=Path, action="append",
                   help="a file that names the model (one per --model; a study gives its run's COMPLETE): its "
                        "digest is recorded as the model's identity, else the weights' (eval.provenance)")
    p.add_argument("--limit", type=int, help="first N problems of each task")
    p.add_argument("--data", action="append", default=[], metavar="TASK=PATH",
                   help="data of a task: .jsonl/.json/.parquet file or hub data set[:subset] (repeatable)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (one sample) instead of sampling")
    p.add_argument("--temperature", type=float, default=1.0, help="(default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default 1.0)")
    p.add_argument("--max-gen-toks", type=int, help="override each task's generation limit")
    p.add_argument("--chat-template", action="store_true", help="prompts through the model's chat template")
    p.add_argument("--batch-size", type=int, default=8, help="(default 8)")
    p.add_argument("--dtype", default="float32", help="(default float32)")
    p.add_argument("--device", default="cpu", help="(default cpu)")
    p.add_argument("--seed", type=int, action="append", help="(default 0; one for all models, or one per --model)")
    return top


def _data(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        task, sep, source = item.partition("=")
        if not sep or not task or not source:
            raise ValueError(f"--data {item!r}: expected TASK=PATH (a .jsonl/.json/.parquet file or a hub data set)")
        pairs[task] = source
    return pairs


def requests(args: argparse.Namespace) -> list[Request]:
    """The evaluations a parsed `run` command asks for, one per --model; UsageError where the per-model options
    do not pair up, ValueError for bad --data."""
    from eval.harness import EvalSettings
    from eval.suites import expand

    models, seeds, records = args.model, args.seed or [0], args.model_record or []
    if len(args.out) != len(models) or len(seeds) not in (1, len(models)) or len(records) not in (0, len(models)):
        raise UsageError(f"--model, --out, --seed and --model-record: one --out per --model, one --seed or one per "
                         f"--model, and no --model-record or one per --model (got {len(models)}, {len(args.out)}, "
                         f"{len(seeds)} and {len(records)})")
    seeds = seeds * len(models) if len(seeds) == 1 else seeds
    data, tasks = _data(args.data), tuple(expand(args.suite))
    return [Request(EvalSettings(
        model=model, tasks=tasks, backend=args.backend, samples=args.samples, greedy=args.greedy,
        temperature=args.temperature, top_p=args.top_p, max_gen_toks=args.max_gen_toks,
        chat_template=args.chat_template, limit=args.limit, batch_size=args.batch_size, dtype=args.dtype,
        device=args.device, seed=seed, data=data), out, records[i] if records else None)
        for i, (model, out, seed) in enumerate(zip(models, args.out, seeds, strict=True))]
