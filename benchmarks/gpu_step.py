"""One SmolLM2 study step against the device's bounds: time a few steps of one grid point per variant
(an engine, a decoding mode, a dtype, several processes at once), and set each against the compute
bound and the memory-bandwidth bound computed for it.

Each variant runs `python -m trainer train` on the study's run config (workflow/config/smol.yaml, one
grid point, `--point`) with the variant's overrides, for `--steps` steps, in K processes at once (K
from `NAME@K`; seeds 0..K-1). Its step is the median over the steps after the first (which compiles
and warms up) of `step_time`, split into `gen_time` (rollouts) and `train_time` (reward, reference and
policy passes, update), and its tokens a second are (prompt + generated tokens) x K / step time.

The bounds use the device's own peak rates, measured first: a large matrix product in the run's
dtype, or in bfloat16 with `train.mixed_precision: bf16` (FLOP/s), and a large device-to-device copy
(bytes/s, read plus written). For the run's model
with N_m weights in its matrix products (every linear layer and the output layer) and T tokens in a
step (prompts and completions):

- compute: 2 N_m T FLOPs for the generation's forward passes, 2 N_m T for the reference's, 6 N_m T
  for the policy's forward and backward, 2 N_m T more with gradient checkpointing (its recompute),
  plus the attention's 4 d L T c-bar (c-bar the mean context) per forward-equivalent pass;
- memory: every decoding step reads the weights once, and the KV cache of every running sequence.

    python benchmarks/gpu_step.py --model DIR --out OUT [--steps 4] [--point k3-loss]
        [--variant 'hf-compiled=rollout.hf_decoding=compiled'] [--variant 'hf-x10@10=rollout.hf_decoding=eager']

Writes OUT/gpu_step.json and OUT/gpu_step.md (and prints the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sweep.study.checks import merge  # noqa: E402
from sweep.study.grid import load_study  # noqa: E402
from trainer.run_files import read_metrics  # noqa: E402

DEFAULT_VARIANTS = ["hf-eager=rollout.hf_decoding=eager", "hf-compiled=rollout.hf_decoding=compiled"]


def parse_variant(text: str) -> tuple[str, int, list[str]]:
    """`NAME[@K]=key=value;key=value` as (name, processes, overrides)."""
    head, _, rest = text.partition("=")
    name, _, count = head.partition("@")
    return name, int(count or 1), [item for item in rest.split(";") if item]


def setting(overrides: list[str], key: str, default):
    """The last override of `key` among `key=value` strings, else `default`."""
    return next((item.split("=", 1)[1] for item in reversed(overrides) if item.startswith(key + "=")), default)


def peak_rates(device: str, dtype: str) -> dict:
    """The device's matrix-product rate in `dtype` and its copy bandwidth, measured now."""
    import torch

    size = 8192 if device == "cuda" else 1024
    kind = getattr(torch, dtype)
    a = torch.randn(size, size, device=device, dtype=kind)
    b = torch.randn(size, size, device=device, dtype=kind)

    def timed(fn, repeats: int) -> float:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats

    flops = 2 * size**3 / timed(lambda: a @ b, 10)
    src = torch.empty(256 * 2**20 if device == "cuda" else 32 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / timed(lambda: dst.copy_(src), 10)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device_name": name, "dtype": dtype, "flops_per_s": flops, "bytes_per_s": bandwidth,
            "torch": torch.__version__}


def model_shape(model: str) -> dict:
    config = json.loads((Path(model) / "config.json").read_text())
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * d // heads
    ffn = config["intermediate_size"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn
    return {"hidden": d, "layers": layers, "kv_dim": kv, "vocab": config["vocab_size"],
            "matmul_weights": layers * per_layer + config["vocab_size"] * d}


def bounds(shape: dict, steps: list[dict], sequences: int, rates: dict, bytes_per_weight: int, recompute: bool,
           processes: int) -> dict:
    """Compute and memory-bandwidth bounds of one step (of `processes` runs at once), in seconds. T is
    the step's trained tokens (prompts and completions, no padding); decoding takes at least the mean
    completion's length in steps (the longest is not logged, so the memory bound errs low)."""
    tokens = statistics.median(m["trained_tokens"] for m in steps)
    generated = statistics.median(m["generated_tokens"] for m in steps)
    decode_steps = generated / sequences
    mean_context = tokens / sequences / 2
    per_token = 2 * shape["matmul_weights"] + 4 * shape["hidden"] * shape["layers"] * mean_context
    passes = 1 + 1 + 3 + (1 if recompute else 0)  # generation, reference, policy fwd+bwd, recompute
    flop = passes * per_token * tokens * processes
    weights = bytes_per_weight * shape["matmul_weights"]
    kv_per_token = 2 * shape["layers"] * shape["kv_dim"] * bytes_per_weight  # keys and values
    kv_read = decode_steps * sequences * kv_per_token * mean_context  # every step reads every sequence's cache
    memory = (decode_steps * weights + kv_read) * processes
    return {"tokens": tokens * processes, "flop": flop, "compute_s": flop / rates["flops_per_s"],
            "decode_bytes": memory, "memory_s": memory / rates["bytes_per_s"]}


def run_variant(name: str, processes: int, overrides: list[str], point, model: str, out: Path, steps: int,
                timeout: float) -> list[list[dict]]:
    """Train the point `processes` times at once; each run's metrics lines."""
    handles = []
    for k in range(processes):
        directory = out / name / f"seed{k}"
        directory.mkdir(parents=True, exist_ok=True)
        log = (directory / "train.log").open("w")
        command = [sys.executable, "-m", "trainer", "train", "--out", str(directory), *point.overrides(),
                   f"model.path={model}", f"train.steps={steps}", f"train.seed={k}", "checkpoint.every=1000",
                   "measure.prompts=0", *overrides]
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        if processes > 1:
            env["OMP_NUM_THREADS"] = "1"
        handles.append((subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = time.monotonic() + timeout
    for process, log in handles:
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    runs = []
    for k in range(processes):
        path = out / name / f"seed{k}" / "metrics.jsonl"
        runs.append(read_metrics(path) if path.exists() else [])
    return runs


def summarize(name: str, processes: int, overrides: list[str], runs: list[list[dict]], shape: dict, rates: dict,
              dtype: str, recompute: bool, sequences: int) -> dict:
    timed = [m for lines in runs for m in lines[1:]]
    if not timed:
        return {"variant": name, "processes": processes, "overrides": overrides, "error": "no timed steps"}
    step = statistics.median(m["step_time"] for m in timed)
    bound = bounds(shape, timed, sequences, rates, 2 if dtype in ("bfloat16", "float16") else 4, recompute, processes)
    return {"variant": name, "processes": processes, "overrides": overrides, "timed_steps": len(timed),
            "step_s": step, "gen_s": statistics.median(m["gen_time"] for m in timed),
            "train_s": statistics.median(m["train_time"] for m in timed),
            "first_step_s": statistics.median(lines[0]["step_time"] for lines in runs if lines),
            "tokens_per_s": bound["tokens"] / step, **bound,
            "x_compute": step / bound["compute_s"], "x_memory": step / bound["memory_s"],
            "x_bound": step / max(bound["compute_s"], bound["memory_s"])}


def table(rows: list[dict]) -> str:
    lines = ["| variant | processes | step s | generation s | train s | first step s | tokens/s | "
             "compute bound s | memory bound s | x bound |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['processes']} | {r['error']} |||||||| ")
            continue
        lines.append(f"| {r['variant']} | {r['processes']} | {r['step_s']:.3f} | {r['gen_s']:.3f} | "
                     f"{r['train_s']:.3f} | {r['first_step_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['compute_s']:.4f} | {r['memory_s']:.4f} | {r['x_bound']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the imported SmolLM2 directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=REPO / "workflow" / "config" / "smol.yaml")
    parser.add_argument("--point", default="k3-loss", help="the grid point (default k3-loss: its first seed)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variant", action="append", help="NAME[@K]=key=value;key=value (repeatable)")
    parser.add_argument("--set", action="append", default=[], help="an override for every variant")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    args = parser.parse_args()
    study = load_study(merge({}, yaml.safe_load(args.config.read_text())))
    point = next(run for run in study.runs if f"__{args.point}__" in run.run_id)
    config = point.config
    device = setting(args.set, "model.device", config["model"]["device"])
    args.out.mkdir(parents=True, exist_ok=True)
    shape = model_shape(args.model)
    rates_by_dtype: dict[str, dict] = {}
    rows = []
    for text in args.variant or DEFAULT_VARIANTS:
        name, processes, overrides = parse_variant(text)
        overrides = [*args.set, *overrides]
        dtype = setting(overrides, "model.dtype", config["model"]["dtype"])  # the weights'
        mixed = setting(overrides, "train.mixed_precision", config["train"].get("mixed_precision", "no"))
        arithmetic = "bfloat16" if mixed == "bf16" else dtype  # the bound takes the faster rate where mixed
        if arithmetic not in rates_by_dtype:
            rates_by_dtype[arithmetic] = peak_rates(device, arithmetic)
        recompute = str(setting(overrides, "train.gradient_checkpointing",
                                config["train"].get("gradient_checkpointing", False))).lower() == "true"
        t0 = time.monotonic()
        runs = run_variant(name, processes, overrides, point, args.model, args.out, args.steps, args.timeout)
        sequences = int(setting(overrides, "train.prompts_per_step", config["train"]["prompts_per_step"])) * int(
            setting(overrides, "train.group_size", config["train"]["group_size"]))
        row = summarize(name, processes, overrides, runs, shape, rates_by_dtype[arithmetic], dtype, recompute,
                        sequences)
        row["wall_s"] = time.monotonic() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"point": point.run_id, "model": shape, "rates": rates_by_dtype, "rows": rows}
    (args.out / "gpu_step.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(rows)
    (args.out / "gpu_step.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
