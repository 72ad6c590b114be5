"""Command line of the evaluation: `python -m eval run ...`."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("eval")


def _data(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        task, sep, source = item.partition("=")
        if not sep or not task or not source:
            raise ValueError(f"--data {item!r}: expected TASK=PATH (a .jsonl/.json/.parquet file or a hub data set)")
        pairs[task] = source
    return pairs


def main(argv: list[str] | None = None) -> int:
    from eval.suites import SUITES, TASKS

    parser = argparse.ArgumentParser(prog="python -m eval", description="klstudy's evaluation (lm-eval tasks)")
    sub = parser.add_subparsers(dest="command", required=True)
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from eval.harness import METRICS_FILE, EvalSettings, evaluate
    from eval.suites import expand

    seeds = args.seed or [0]
    if len(args.out) != len(args.model) or len(seeds) not in (1, len(args.model)):
        log.error("--model, --out and --seed: one --out per --model, and one --seed or one per --model "
                  "(got %d, %d and %d)", len(args.model), len(args.out), len(seeds))
        return 2
    failed = []
    for model, out, seed in zip(args.model, args.out, seeds * len(args.model) if len(seeds) == 1 else seeds,
                                strict=True):
        if (out / METRICS_FILE).is_file():  # a finished evaluation is never rewritten (a requeued job's)
            log.info("%s already holds a finished evaluation (%s): nothing to do; delete it to evaluate again",
                     out, METRICS_FILE)
            print(json.dumps({"out": str(out)}))
            continue
        try:
            settings = EvalSettings(
                model=model, tasks=tuple(expand(args.suite)), backend=args.backend, samples=args.samples,
                greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, max_gen_toks=args.max_gen_toks,
                chat_template=args.chat_template, limit=args.limit, batch_size=args.batch_size, dtype=args.dtype,
                device=args.device, seed=seed, data=_data(args.data))
            metrics = evaluate(settings, out)
        except Exception as error:  # noqa: BLE001 - one model's failure stops no other evaluation of the job
            if isinstance(error, ValueError):  # bad options, model or data: one line, no traceback
                log.error("%s: %s", model, error)
            else:
                log.exception("%s: the evaluation failed", model)
            failed.append(str(out))
            continue
        for task, row in metrics["tasks"].items():
            extra = f"  pass@{row['pass@k']['k']} {row['pass@k']['value']:.3f}" if "pass@k" in row else ""
            stderr = f" ± {row['stderr']:.3f}" if row["stderr"] is not None else ""
            print(f"{task:24s} pass@1 {row['value']:.3f}{stderr}  (n={row['n']}){extra}")
        print(json.dumps({"out": str(out)}))
    if failed:
        log.error("%d of %d evaluations failed: %s", len(failed), len(args.model), ", ".join(failed))
        return 2
    return 0


if __name__ == "__main__":
    status = main()
    gc.freeze()  # the interpreter's last collections skip lm-eval's, torch's and the models' objects: about 1 s of CPU
    sys.exit(status)
