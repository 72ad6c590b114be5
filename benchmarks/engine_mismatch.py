"""How far each rollout engine and precision samples from the distribution the trainer computes.

A model trains a few steps per setting, side by side, with truncated importance sampling on
(objective.tis_cap 2): the warm toy (a tiny Llama after a supervised warm-up on one-digit sums,
completions of up to 4 tokens), or with --model qwen0.5b-shape a random model of Qwen2.5-0.5B's
sizes (`trainer.model.models.QWEN_05B_SHAPE`; completions of up to 32 tokens). Each step
logs the engine's log-probs of its own samples against the trainer's log-probs of the same tokens
under the same weights; this prints their medians over the steps, per setting:

    mismatch_logp_mean  mean |log mu_engine - log pi_trainer| over sampled tokens
    mismatch_logp_max   the largest such gap in a step
    mismatch_kl         KL(mu_engine || pi_trainer) per token (k3 estimate from the engine's samples)
    tis_weight_mean     the mean truncated weight min(pi_trainer / mu_engine, 2)

Settings (--settings, comma-separated): fp32 (float32 everywhere), bf16 (model.dtype bfloat16:
engine and trainer both compute in bfloat16, the engine with its KV cache), mixed (float32 weights,
train.mixed_precision bf16: the trainer and the hf engine compute under bf16 autocast), vllm (the
vLLM engine, float32), vllm-bf16 (vLLM in bfloat16, the trainer in bfloat16 too). The last line is
    mismatch_kl <setting>=<value> ...

    python benchmarks/engine_mismatch.py [--device cpu|cuda] [--settings fp32,mixed] [--steps 8]
                                         [--model warm-toy|qwen0.5b-shape]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {
    "fp32": {},
    "bf16": {"model.dtype": "bfloat16"},
    "mixed": {"train.mixed_precision": "bf16"},
    "vllm": {"rollout.engine": "vllm"},
    "vllm-bf16": {"rollout.engine": "vllm", "model.dtype": "bfloat16"},
}
KEYS = ("mismatch_logp_mean", "mismatch_logp_max", "mismatch_kl", "tis_weight_mean", "reward_mean")


def build(name: str, out: Path) -> Path:
    from trainer.model.models import QWEN_05B_SHAPE, ToyModelSpec, build_toy_model
    from trainer.sft import sft

    if name == "qwen0.5b-shape":
        return build_toy_model(out / name, QWEN_05B_SHAPE)
    build_toy_model(out / "toy", ToyModelSpec())
    sft(str(out / "toy"), "arithmetic", out / name, {"max_operand": 9}, steps=300, batch_size=64)
    return out / name


# What each model's runs sample: the toy answers in a few tokens; the random model rambles.
SHAPES = {"warm-toy": {"rollout.max_new_tokens": 4, "train.prompts_per_step": 32, "train.group_size": 8},
          "qwen0.5b-shape": {"rollout.max_new_tokens": 32, "train.prompts_per_step": 16, "train.group_size": 4}}


def child(setting: str, model: str, device: str, steps: int, result: str) -> None:
    """One setting's run, in a process of its own (a vLLM engine holds its process's devices)."""
    from trainer import config as run_config
    from trainer.run import Run

    overrides = {"model.path": model, "model.device": device, "task.options": "{max_operand: 9}",
                 "rollout.stop": '["\\n"]', "objective.estimator": "k3", "objective.placement": "reward+loss",
                 "objective.beta": 0.05, "objective.tis_cap": 2.0, "train.steps": steps, "train.lr": "3e-4",
                 "checkpoint.every": steps + 1, **SHAPES[Path(model).name], **SETTINGS[setting]}
    config = run_config.load(None, [f"{k}={v}" for k, v in overrides.items()])
    run = Run(config, Path(tempfile.mkdtemp()) / "run")
    lines = [run.run_step() for _ in range(steps)]
    run.verifier.close()
    Path(result).write_text(json.dumps(lines))


def measure(setting: str, model: Path, device: str, steps: int) -> dict[str, float]:
    result = Path(tempfile.mkdtemp()) / "result.json"
    done = subprocess.run([sys.executable, __file__, "--child", setting, "--model-dir", str(model), "--device", device,
                           "--steps", str(steps), "--result", str(result)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{setting} failed:\n{done.stderr[-3000:]}")
    lines = json.loads(result.read_text())
    return {key: statistics.median(line[key] for line in lines) for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--settings", default="fp32,bf16,mixed", help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="warm-toy", choices=list(SHAPES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model_dir, args.device, args.steps, args.result)
        return
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: {', '.join(unknown)} not among {', '.join(SETTINGS)}")
    model = build(args.model, Path(tempfile.mkdtemp()))
    results = {setting: measure(setting, model, args.device, args.steps) for setting in settings}
    print(f"{'setting':10s} " + " ".join(f"{key:>19s}" for key in KEYS) + f"   (medians over {args.steps} steps, "
          f"{args.model}, device {args.device})")
    for setting, values in results.items():
        print(f"{setting:10s} " + " ".join(f"{values[key]:19.3g}" for key in KEYS), flush=True)
    print("mismatch_kl " + " ".join(f"{s}={v['mismatch_kl']:.3g}" for s, v in results.items()))


if __name__ == "__main__":
    main()
