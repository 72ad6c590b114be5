"""The cost of estimator full in the training loop: a step with the exact full-vocabulary KL against
the same step with k1, everything else equal.

Both sides train the same freshly built toy Llama, its vocabulary padded with unused tokens to a real
model's size (so that the sum over the vocabulary costs what it would), on the same arithmetic
prompts, with the KL in the reward and the loss. Each side runs `trainer.run.Run.run_step` in its own
child process, alternately, for several rounds. A side's step time, train time (everything after
generation: the reference pass, the sampler's KL for the reward, forward and backward) and the
child's peak resident memory are reported; the last line is
    step_time_ratio=<full / k1> train_time_ratio=<full / k1> memory_ratio=<full / k1>

    python benchmarks/full_kl_step.py [--rounds 2] [--steps 4] [--vocab 32768] [--prompts 4] [--group 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ESTIMATORS = ("k1", "full")


def run_side(estimator: str, args: argparse.Namespace) -> list[dict[str, float]]:
    from trainer import config as run_config
    from trainer.run import Run

    config = run_config.load(None, [
        f"model.path={args.model}", "task.name=arithmetic", f"rollout.max_new_tokens={args.length}",
        f"objective.estimator={estimator}", "objective.placement=reward+loss", "objective.beta=0.05",
        f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}", f"train.group_size={args.group}",
        f"train.logprob_chunk={args.chunk}", f"checkpoint.every={args.steps + 1}"])
    run = Run(config, Path(tempfile.mkdtemp()) / "run")
    lines = [run.run_step() for _ in range(args.steps)]
    run.verifier.close()
    return [{key: line[key] for key in ("step_time", "train_time", "trained_tokens")} for line in lines]


def measure(estimator: str, args: argparse.Namespace) -> dict[str, float]:
    """Mean step and train time over the steps after the first, and the child's peak RSS in MiB."""
    result = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, __file__, "--child", estimator, "--result", str(result)]
    command += [f"--{key}={value}" for key, value in vars(args).items() if key not in ("child", "result", "rounds")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise SystemExit(f"the {estimator} side failed:\n{process.stderr.read()[-3000:]}")
    steps = json.loads(result.read_text())[1:]  # the first step warms up
    return {"step_time": statistics.mean(s["step_time"] for s in steps),
            "train_time": statistics.mean(s["train_time"] for s in steps),
            "trained_tokens": statistics.mean(s["trained_tokens"] for s in steps), "peak_mib": usage.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768, help="the padded vocabulary (default 32768)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=1024, help="train.logprob_chunk")
    parser.add_argument("--model", help="a model directory (default: a toy Llama built with --vocab)")
    parser.add_argument("--child", choices=ESTIMATORS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(run_side(args.child, args)))
        return
    if args.model is None:
        from trainer.model.models import ToyModelSpec, build_toy_model

        spec = ToyModelSpec(hidden_size=128, num_layers=4, intermediate_size=512, vocab_size=args.vocab)
        args.model = str(build_toy_model(Path(tempfile.mkdtemp()) / "model", spec))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in ESTIMATORS}
    for _ in range(args.rounds):
        for name in ESTIMATORS:
            results[name].append(measure(name, args))
    mean = {name: {key: statistics.mean(r[key] for r in rs) for key in rs[0]} for name, rs in results.items()}
    print(f"vocabulary {args.vocab}, {args.prompts} prompts x {args.group} samples of up to {args.length} tokens, "
          f"KL in the reward and the loss, {args.rounds} rounds of {args.steps} steps")
    for name, m in mean.items():
        print(f"{name:4s}: step {m['step_time']:.3f} s, train {m['train_time']:.3f} s "
              f"({m['trained_tokens']:.0f} tokens), peak {m['peak_mib']:.0f} MiB")
    full, k1 = mean["full"], mean["k1"]
    print(f"step_time_ratio={full['step_time'] / k1['step_time']:.3f} "
          f"train_time_ratio={full['train_time'] / k1['train_time']:.3f} "
          f"memory_ratio={full['peak_mib'] / k1['peak_mib']:.3f}")


if __name__ == "__main__":
    main()
