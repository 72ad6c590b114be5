"""klstudy's trainer against TRL's GRPOTrainer: same model, prompts, batch, lengths and objective.

Both sides train the same freshly built model on the same arithmetic prompts: B prompts x G
completions of up to L tokens per step, k3 in the loss with the same beta, GRPO advantages (group
std scaling), sequence-mean-of-token-mean aggregation, ratio clip 0.2, one update per batch, gradient
checkpointing as `--gradient-checkpointing` says (off by default; TRL's own default is on, and its
recompute and memory were once compared against klstudy without it). Each
side runs in its own child process, alternately, several rounds; a side's throughput is
(generated + trained tokens) / step time over the steps after the first (which warms up, and
compiles where klstudy's hf engine compiles its decoding), its memory the child's peak.

--device cpu (the default): a toy Llama (1.06 M parameters) in float32, peak resident set size.
--device cuda: a random model of Qwen2.5-0.5B's shape (`trainer.model.models.QWEN_05B_SHAPE`, built here,
nothing downloaded), bf16 weights on both sides, peak GPU memory allocated; klstudy's hf engine
decodes compiled (rollout.hf_decoding auto). A check runs first (--check: only it): TRL imports, and
klstudy's engine decodes compiled on the device and samples what its trainer computes.
The last line is
    speedup=<klstudy/TRL throughput> memory=<klstudy/TRL peak memory>

    python benchmarks/trainer_vs_trl.py [--device cpu|cuda] [--rounds 2] [--steps 6] [--prompts 8]
                                        [--group 8] [--length 32] [--gradient-checkpointing] [--check]
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
# What each device trains by default: the toy on a CPU, a model of a real one's shape on a GPU.
SETUPS = {"cpu": {"prompts": 8, "group": 8, "length": 32, "steps": 6},
          "cuda": {"prompts": 16, "group": 8, "length": 64, "steps": 6}}


def build_model(out: Path, device: str = "cpu") -> Path:
    from trainer.model.models import QWEN_05B_SHAPE, ToyModelSpec, build_toy_model

    toy = ToyModelSpec(hidden_size=128, num_layers=4, intermediate_size=512, seed=0)
    return build_toy_model(out, QWEN_05B_SHAPE if device == "cuda" else toy)


def dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


def synchronize(device: str) -> None:
    """Wait for the device's queued work, so that a step's time is its own."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_klstudy(args: argparse.Namespace, model: Path) -> dict:
    from trainer import config as run_config
    from trainer.run import Run

    config = run_config.load(None, [
        f"model.path={model}", f"model.device={args.device}", f"model.dtype={dtype(args.device)}",
        "task.name=arithmetic", f"rollout.max_new_tokens={args.length}",
        "objective.estimator=k3", "objective.placement=loss", f"objective.beta={BETA}", "objective.advantage=grpo",
        "objective.loss_agg=seq-mean-token-mean", f"objective.clip_eps={CLIP}", f"train.steps={args.steps}",
        f"train.prompts_per_step={args.prompts}", f"train.group_size={args.group}", f"train.lr={LR}",
        f"checkpoint.every={args.steps + 1}",
        f"train.gradient_checkpointing={str(args.gradient_checkpointing).lower()}"])
    run = Run(config, Path(tempfile.mkdtemp()) / "run")
    steps = []
    for _ in range(args.steps):
        synchronize(args.device)
        start = time.perf_counter()
        m = run.run_step()
        synchronize(args.device)
        steps.append({"time": time.perf_counter() - start, "tokens": m["generated_tokens"] + m["trained_tokens"],
                      "generation": m["gen_time"]})
    run.verifier.close()
    from trainer.rollout.decoding import compile_failure

    failed = f" (compiling failed: {compile_failure()})" if compile_failure() else ""
    return {"steps": steps, "decoding": "compiled" if run.engine.decoder.compiled else f"eager{failed}"}


def run_trl(args: argparse.Namespace, model: Path) -> dict:
    import torch
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
        output_dir=tempfile.mkdtemp(), use_cpu=args.device == "cpu", bf16=args.device == "cuda", report_to="none",
        save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=args.steps, per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.length, learning_rate=LR, lr_scheduler_type="constant",
        beta=BETA, loss_type="grpo", scale_rewards="group", use_bias_correction_kl=False, epsilon=CLIP,
        temperature=1.0, top_p=1.0, num_iterations=1, gradient_accumulation_steps=1, seed=0, shuffle_dataset=False,
        dataloader_num_workers=0, max_grad_norm=1.0, gradient_checkpointing=args.gradient_checkpointing)
    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype(args.device)))
    trainer = GRPOTrainer(model=lm, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer)
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
            synchronize(args.device)
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            synchronize(args.device)
            times.append(time.perf_counter() - self.start)

    trainer.add_callback(Timer())
    trainer.train()
    verifier.close()
    return {"steps": [{"time": t, "tokens": n} for t, n in zip(times, counts, strict=True)]}


def check(args: argparse.Namespace, model: Path) -> dict:
    """What the run needs, in a minute: TRL and its data sets import, and klstudy's hf engine decodes as
    it should on the device (compiled on CUDA) and samples what its trainer computes (the toy, float32)."""
    import importlib.metadata

    import datasets  # noqa: F401  (TRL's data sets)
    import torch
    import trl  # noqa: F401

    from trainer.batch import pack
    from trainer.model.logprobs import completion_logprobs
    from trainer.model.models import load_model, load_tokenizer
    from trainer.rollout.base import SamplingParams, sample_seeds
    from trainer.rollout.hf import HFEngine

    tokenizer, lm = load_tokenizer(str(model)), load_model(str(model), "float32", args.device)
    engine = HFEngine(lm, tokenizer)
    prompts = [tokenizer(t)["input_ids"] for t in ("12+7=", "3-1=", "a longer prompt: 100+250=")]
    rollouts = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=16), sample_seeds(0, 0, len(prompts)))
    batch = pack(rollouts, tokenizer.pad_token_id).to(args.device)
    with torch.no_grad():
        trainer_logp, _ = completion_logprobs(lm, batch)
    gap = float(((trainer_logp - batch.behaviour_logp) * batch.completion_mask).abs().max())
    if engine.decoder.compiled != (args.device == "cuda") or gap > 1e-3:
        raise SystemExit(f"check failed: compiled decoding {engine.decoder.compiled}, max |engine - trainer| "
                         f"log-prob {gap:.2e} (the log above says why)")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    decoding = "compiled" if engine.decoder.compiled else "eagerly"
    return {"trl": importlib.metadata.version("trl"), "device": device, "decoding": decoding, "gap": gap}


def child(side: str, args: argparse.Namespace) -> None:
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    result = {"klstudy": run_klstudy, "trl": run_trl, "check": check}[side](args, Path(args.model))
    if args.device == "cuda":
        result["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(args.result).write_text(json.dumps(result))


def run_child(side: str, args: argparse.Namespace, model: Path) -> tuple[dict, float]:
    """(what the child wrote, its peak RSS in MiB)."""
    result_file = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, __file__, "--child", side, "--model", str(model), "--result", str(result_file),
               "--device", args.device, "--steps", str(args.steps), "--prompts", str(args.prompts),
               "--group", str(args.group), "--length", str(args.length),
               *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]
    log_file = result_file.with_name("stderr.txt")
    with log_file.open("w") as log:  # a file, not a pipe: a chatty child cannot fill it and stall
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise SystemExit(f"{side} run failed:\n{log_file.read_text()[-5000:]}")
    return json.loads(result_file.read_text()), usage.ru_maxrss / 1024


def measure(side: str, args: argparse.Namespace, model: Path) -> tuple[float, float, float, str]:
    """(throughput in tokens/s over the steps after the first, peak memory in MiB: resident on a CPU,
    GPU memory allocated on CUDA, the first step's seconds, how klstudy's engine decoded and its share
    of a step) of one run."""
    result, rss = run_child(side, args, model)
    first, *steps = result["steps"]  # the first step warms up
    throughput = sum(s["tokens"] for s in steps) / sum(s["time"] for s in steps)
    decoding = result.get("decoding", "")
    if steps and "generation" in steps[0]:
        share = sum(s["generation"] for s in steps) / sum(s["time"] for s in steps)
        decoding += f", generation {share:.0%} of a step"
    return throughput, result.get("gpu_peak_mib", rss), first["time"], decoding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=list(SETUPS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, help="per run (default: 6)")
    parser.add_argument("--prompts", type=int, help="per step (default: 8 on a CPU, 16 on CUDA)")
    parser.add_argument("--group", type=int, help="completions per prompt (default: 8)")
    parser.add_argument("--length", type=int, help="new tokens at most (default: 32 on a CPU, 64 on CUDA)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="on both sides (default: off on both)")
    parser.add_argument("--check", action="store_true", help="only check that the run can work (CUDA)")
    parser.add_argument("--child", choices=["klstudy", "trl", "check"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in SETUPS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.child:
        child(args.child, args)
        return
    root = Path(tempfile.mkdtemp())
    if args.device == "cuda" or args.check:
        checked, _ = run_child("check", args, build_model(root / "check"))
        print(f"check: {checked['device']}, klstudy's hf engine decodes {checked['decoding']} (max |engine - trainer| "
              f"log-prob {checked['gap']:.1e}), trl {checked['trl']}", flush=True)
        if args.check:
            return
    model = build_model(root / "model", args.device)
    unit = "GPU MiB" if args.device == "cuda" else "MiB RSS"
    runs: dict[str, list[tuple[float, float, float, str]]] = {"klstudy": [], "trl": []}
    for round_ in range(args.rounds):
        for side in ("klstudy", "trl"):
            runs[side].append(measure(side, args, model))
            rate, peak, first, decoding = runs[side][-1]
            print(f"round {round_ + 1} {side:8s} {rate:9.1f} tokens/s  peak {peak:8.1f} {unit}  "
                  f"first step {first:.1f} s  {decoding}", flush=True)
    throughput = {side: statistics.median(r[0] for r in rs) for side, rs in runs.items()}
    memory = {side: statistics.median(r[1] for r in rs) for side, rs in runs.items()}
    print(f"batch {args.prompts} prompts x {args.group}, up to {args.length} new tokens, {args.steps} steps, "
          f"{dtype(args.device)} on {args.device}, {os.cpu_count()} CPUs")
    for side in runs:
        print(f"{side:8s} median {throughput[side]:9.1f} tokens/s  peak {memory[side]:8.1f} {unit}")
    print(f"speedup={throughput['klstudy'] / throughput['trl']:.2f} memory={memory['klstudy'] / memory['trl']:.2f}")


if __name__ == "__main__":
    main()
