"""klstudy's trainer against TRL's GRPOTrainer: same model, prompts, batch, lengths and objective.

Both sides train a freshly built toy Llama on CPU, on the same arithmetic prompts: B prompts x G
completions of up to L tokens per step, k3 in the loss with the same beta, GRPO advantages (group
std scaling), sequence-mean-of-token-mean aggregation, ratio clip 0.2, one update per batch. Each
side runs in its own child process, alternately, several rounds; a side's throughput is
(generated + trained tokens) / step time over the steps after the first, and its peak memory is
the child's peak resident set size. The last line is
    speedup=<klstudy/TRL throughput> memory=<klstudy/TRL peak memory>

    python benchmarks/trainer_vs_trl.py [--rounds 2] [--steps 6] [--prompts 8] [--group 8] [--length 32]
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

BETA, LR, CLIP = 0.04, 1e-5, 0.2


def build_model(out: Path) -> Path:
    from trainer.models import ToyModelSpec, build_toy_model

    return build_toy_model(out, ToyModelSpec(hidden_size=128, num_layers=4, intermediate_size=512, seed=0))


def run_klstudy(args: argparse.Namespace, model: Path) -> dict:
    from trainer import config as run_config
    from trainer.loop import Run

    config = run_config.load(None, [
        f"model.path={model}", "task.name=arithmetic", f"rollout.max_new_tokens={args.length}",
        "objective.estimator=k3", "objective.placement=loss", f"objective.beta={BETA}", "objective.advantage=grpo",
        "objective.loss_agg=seq-mean-token-mean", f"objective.clip_eps={CLIP}", f"train.steps={args.steps}",
        f"train.prompts_per_step={args.prompts}", f"train.group_size={args.group}", f"train.lr={LR}",
        f"checkpoint.every={args.steps + 1}"])
    run = Run(config, Path(tempfile.mkdtemp()) / "run")
    steps = []
    for _ in range(args.steps):
        m = run.run_step()
        steps.append({"time": m["step_time"], "tokens": m["generated_tokens"] + m["trained_tokens"]})
    run.verifier.close()
    return {"steps": steps}


def run_trl(args: argparse.Namespace, model: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from eval.verify import Verifier
    from trainer.tasks import make_task

    task = make_task("arithmetic")
    problems = [task.problem(i) for i in range(args.prompts * args.steps)]
    data = Dataset.from_dict({"prompt": [p.question for p in problems], "answer": [p.answer for p in problems]})
    verifier = Verifier()

    def reward(completions, answer, **_):
        return verifier.score_many(list(zip(completions, answer, strict=True)))

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=args.steps, per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.length, learning_rate=LR, lr_scheduler_type="constant",
        beta=BETA, loss_type="grpo", scale_rewards="group", use_bias_correction_kl=False, epsilon=CLIP,
        temperature=1.0, top_p=1.0, num_iterations=1, gradient_accumulation_steps=1, seed=0, shuffle_dataset=False,
        dataloader_num_workers=0, max_grad_norm=1.0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=reward, args=config,
                          train_dataset=data, processing_class=tokenizer)
    counts: list[int] = []
    original = trainer._generate_and_score_completions

    def counting(inputs):  # generated + trained tokens, counted as klstudy counts them
        out = original(inputs)
        generated = int(out["completion_mask"].sum())
        counts.append(generated + int(out["prompt_mask"].sum()) + generated)
        return out

    trainer._generate_and_score_completions = counting
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    trainer.add_callback(Timer())
    trainer.train()
    verifier.close()
    return {"steps": [{"time": t, "tokens": n} for t, n in zip(times, counts, strict=True)]}


def child(side: str, args: argparse.Namespace) -> None:
    import torch

    torch.manual_seed(0)
    result = {"klstudy": run_klstudy, "trl": run_trl}[side](args, Path(args.model))
    Path(args.result).write_text(json.dumps(result))


def measure(side: str, args: argparse.Namespace, model: Path) -> tuple[float, float]:
    """(throughput in tokens/s over the steps after the first, peak RSS in MiB) of one child run."""
    result_file = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, __file__, "--child", side, "--model", str(model), "--result", str(result_file),
               "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
               "--length", str(args.length)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise SystemExit(f"{side} run failed:\n{process.stderr.read()}")
    steps = json.loads(result_file.read_text())["steps"][1:]  # the first step warms up
    throughput = sum(s["tokens"] for s in steps) / sum(s["time"] for s in steps)
    return throughput, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--child", choices=["klstudy", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args)
        return
    model = build_model(Path(tempfile.mkdtemp()) / "toy")
    runs: dict[str, list[tuple[float, float]]] = {"klstudy": [], "trl": []}
    for round_ in range(args.rounds):
        for side in ("klstudy", "trl"):
            runs[side].append(measure(side, args, model))
            print(f"round {round_ + 1} {side:8s} {runs[side][-1][0]:9.1f} tokens/s  peak {runs[side][-1][1]:7.1f} MiB",
                  flush=True)
    throughput = {side: statistics.median(t for t, _ in r) for side, r in runs.items()}
    memory = {side: statistics.median(m for _, m in r) for side, r in runs.items()}
    print(f"batch {args.prompts} prompts x {args.group}, up to {args.length} new tokens, {args.steps} steps, "
          f"{os.cpu_count()} CPUs")
    for side in runs:
        print(f"{side:8s} median {throughput[side]:9.1f} tokens/s  peak {memory[side]:7.1f} MiB")
    print(f"speedup={throughput['klstudy'] / throughput['trl']:.2f} memory={memory['klstudy'] / memory['trl']:.2f}")


if __name__ == "__main__":
    main()
