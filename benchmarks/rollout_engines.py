"""Rollout throughput: the hf engine against vLLM, same prompts, same sampling, each in its own process.

Two randomly initialised models, built here: the toy Llama (64 hidden, 2 layers, 104 tokens) and a
model of a real model's shape (Qwen2.5-0.5B's sizes on the Llama architecture, 494 M parameters,
151,936 tokens; `trainer.model.models.QWEN_05B_SHAPE`). Each engine generates --group samples of up to
--length tokens for each of --prompts arithmetic prompts, through klstudy's own engine interface
(what the trainer calls), with one seed per prompt; a warm-up round first, then --rounds timed
rounds. Throughput is generated tokens per second of generate(); engine start-up is reported apart.
Random weights rarely sample EOS, so both engines generate about the same number of tokens.

vLLM needs `make setup-vllm` (its CPU build) on a CPU; both run in float32 on the CPU. The last
line is the larger model's
    vllm_speedup=<vllm tokens/s / hf tokens/s>

    python benchmarks/rollout_engines.py [--rounds 3] [--prompts 16] [--group 4] [--length 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("toy", "qwen0.5b-shape")


def build(name: str, out: Path) -> Path:
    from trainer.model.models import QWEN_05B_SHAPE, ToyModelSpec, build_toy_model

    return build_toy_model(out / name, QWEN_05B_SHAPE if name == "qwen0.5b-shape" else ToyModelSpec())


def child(engine_name: str, model: str, args: argparse.Namespace) -> None:
    """Start the engine, generate a warm-up round and the timed rounds, write the numbers."""
    import torch

    from trainer import config as run_config
    from trainer.distributed import World, full_parameters
    from trainer.model.models import load_model, load_tokenizer
    from trainer.rollout import make_engine
    from trainer.rollout.base import SamplingParams, sample_seeds
    from trainer.tasks import make_task

    start = time.perf_counter()
    config = run_config.load(None, [f"model.path={model}", f"rollout.engine={engine_name}",
                                    "rollout.vllm_gpu_memory_utilization=0.3", "rollout.vllm_cpu_kvcache_gib=2"])
    tokenizer, lm = load_tokenizer(model), load_model(model)
    engine = make_engine(config, lm, tokenizer, World(), weights=lambda: full_parameters(lm))
    task = make_task("arithmetic")
    prompts = [tokenizer(task.prompt(task.problem(i), tokenizer, False))["input_ids"] for i in range(args.prompts)]
    params = SamplingParams(n=args.group, max_new_tokens=args.length)
    engine.generate(prompts, params, sample_seeds(0, 0, len(prompts)))  # warm-up (vLLM compiles here)
    started = time.perf_counter() - start
    rounds = []
    for r in range(args.rounds):
        seeds = sample_seeds(1, r * len(prompts), len(prompts))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = engine.generate(prompts, params, seeds)
        rounds.append({"seconds": time.perf_counter() - t0, "tokens": sum(len(t) for t in out.token_ids)})
    Path(args.result).write_text(json.dumps({"start": started, "rounds": rounds}))


def measure(engine: str, model: Path, args: argparse.Namespace) -> dict:
    result = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, __file__, "--child", engine, "--model", str(model), "--result", str(result),
               "--rounds", str(args.rounds), "--prompts", str(args.prompts), "--group", str(args.group),
               "--length", str(args.length)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{engine} on {model.name} failed:\n{done.stderr[-3000:]}")
    numbers = json.loads(result.read_text())
    rates = [r["tokens"] / r["seconds"] for r in numbers["rounds"]]
    tokens = statistics.mean(r["tokens"] for r in numbers["rounds"])
    return {"tokens_per_s": statistics.median(rates), "start_s": numbers["start"], "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--child", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args)
        return
    root = Path(tempfile.mkdtemp())
    print(f"{args.prompts} prompts x {args.group} samples, up to {args.length} new tokens, temperature 1, "
          f"{args.rounds} rounds after a warm-up, {os.cpu_count()} CPUs", flush=True)
    speedup = None
    for name in args.models.split(","):
        model = build(name, root)
        hf, vllm = measure("hf", model, args), measure("vllm", model, args)
        speedup = vllm["tokens_per_s"] / hf["tokens_per_s"]
        for engine, r in (("hf", hf), ("vllm", vllm)):
            print(f"{name:15s} {engine:5s} {r['tokens_per_s']:9.1f} tokens/s  ({r['tokens']:.0f} tokens a round; "
                  f"start-up {r['start_s']:.1f} s)", flush=True)
        print(f"{name:15s} speedup {speedup:.2f}", flush=True)
    print(f"vllm_speedup={speedup:.2f}")


if __name__ == "__main__":
    main()
