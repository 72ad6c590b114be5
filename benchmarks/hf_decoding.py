"""The hf engine's decoding, eager against compiled: time per decoding step, per token, and to compile.

Each mode (rollout.hf_decoding eager, compiled) runs in its own process, since compiling is paid once
per process: its first generation (the compile, and CUDA graph capture) is timed apart, then --rounds
generations of --prompts x --group rows of --length new tokens, from a randomly initialised model
built here: the toy Llama of benchmarks/trainer_vs_trl.py, or (--model qwen0.5b-shape) Qwen2.5-0.5B's
sizes (`trainer.model.models.QWEN_05B_SHAPE`, 494 M parameters). A step is one token for every row: the
generation's time over its steps (the prompts' pass included). On CUDA the bound beside it is the
time to read the weights once from memory, their bytes over --bandwidth (an H100's HBM3: about 3e12
bytes/s). The last line is
    decode_speedup=<eager step time / compiled step time> compiled_step_over_bound=<ratio or nan>

    python benchmarks/hf_decoding.py [--device cpu|cuda] [--model toy|qwen0.5b-shape] [--dtype float32]
                                     [--rounds 3] [--prompts 8] [--group 8] [--length 32]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `trainer`

MODES = ("eager", "compiled")


def build(name: str, out: Path) -> Path:
    from trainer.model.models import QWEN_05B_SHAPE, ToyModelSpec, build_toy_model

    spec = QWEN_05B_SHAPE if name == "qwen0.5b-shape" else ToyModelSpec(hidden_size=128, num_layers=4,
                                                                        intermediate_size=512, seed=0)
    return build_toy_model(out / name, spec)


def child(mode: str, args: argparse.Namespace) -> None:
    import torch

    from trainer.model.models import load_model, load_tokenizer
    from trainer.rollout.base import SamplingParams, sample_seeds
    from trainer.rollout.hf import HFEngine
    from trainer.tasks import make_task

    device = torch.device(args.device)
    tokenizer, lm = load_tokenizer(args.model), load_model(args.model, args.dtype, args.device)
    engine = HFEngine(lm, tokenizer, decoding=mode)
    task = make_task("arithmetic")
    prompts = [tokenizer(task.prompt(task.problem(i), tokenizer, False))["input_ids"] for i in range(args.prompts)]
    params = SamplingParams(n=args.group, max_new_tokens=args.length)

    def generate(seed: int) -> tuple[float, int, int]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompts, params, sample_seeds(seed, 0, len(prompts)))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, max(len(t) for t in out.token_ids), sum(len(t) for t in out.token_ids)

    first, _, _ = generate(0)
    rounds = [generate(1 + r) for r in range(args.rounds)]
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    Path(args.result).write_text(json.dumps({
        "first": first, "rounds": rounds, "weights_bytes": weights, "compiled": engine.decoder.compiled,
        "gpu_peak_mib": peak}))


def measure(mode: str, model: Path, args: argparse.Namespace) -> dict:
    result = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, __file__, "--child", mode, "--model-dir", str(model), "--result", str(result),
               "--device", args.device, "--dtype", args.dtype, "--rounds", str(args.rounds),
               "--prompts", str(args.prompts), "--group", str(args.group), "--length", str(args.length)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} decoding failed:\n{done.stderr[-3000:]}")
    numbers = json.loads(result.read_text())
    step = statistics.median(seconds / steps for seconds, steps, _ in numbers["rounds"])
    tokens_per_s = statistics.median(tokens / seconds for seconds, _, tokens in numbers["rounds"])
    steady = statistics.median(seconds for seconds, _, _ in numbers["rounds"])
    return {**numbers, "step_s": step, "tokens_per_s": tokens_per_s, "warm_up_s": numbers["first"] - steady}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="toy", choices=["toy", "qwen0.5b-shape"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--bandwidth", type=float, default=3e12, help="bytes/s of the GPU's memory")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.model = args.model_dir
        child(args.child, args)
        return
    model = build(args.model, Path(tempfile.mkdtemp()))
    print(f"{args.model} in {args.dtype} on {args.device}: {args.prompts} prompts x {args.group} rows, "
          f"{args.length} new tokens, {args.rounds} rounds after the first", flush=True)
    runs = {mode: measure(mode, model, args) for mode in MODES}
    bound = runs["eager"]["weights_bytes"] / args.bandwidth if args.device == "cuda" else math.nan
    for mode, r in runs.items():
        decoded = "compiled" if r["compiled"] else "eager"
        print(f"{mode:8s} ({decoded:8s}) {r['step_s'] * 1e3:8.2f} ms a step  {r['tokens_per_s']:10.1f} tokens/s  "
              f"first generation +{r['warm_up_s']:.1f} s (compile)  GPU peak {r['gpu_peak_mib']:.0f} MiB", flush=True)
    if args.device == "cuda":
        print(f"bound: the weights ({runs['eager']['weights_bytes'] / 2**20:.0f} MiB) read once a step at "
              f"{args.bandwidth / 1e12:.1f} TB/s: {bound * 1e3:.3f} ms a step")
    print(f"decode_speedup={runs['eager']['step_s'] / runs['compiled']['step_s']:.2f} "
          f"compiled_step_over_bound={runs['compiled']['step_s'] / bound:.2f}")


if __name__ == "__main__":
    main()
