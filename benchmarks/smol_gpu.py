"""The SmolLM2 study's grid (workflow/config/smol.yaml) on one GPU, without Snakemake, in slices of time.

For a GPU machine that has the trainer's own dependencies only (torch, transformers, accelerate,
safetensors: no Snakemake, lm-eval, math-verify, vLLM or MLflow) and commands limited in time. Every
run of the grid trains at once, each in its own `python -m trainer train` process on the one GPU: a
135M model leaves room for all of them, and one run alone leaves the GPU idle most of the time (it is
bound by kernel launches). When `--train-minutes` are up, every run still going gets SIGTERM, writes a
checkpoint and stops (exit 75); the same command later resumes them all. Once every run is complete
(or with --evaluate-anyway, at each run's newest checkpoint), the runs' models and the base model are
scored on held-out problems of the study's evaluation data (in-domain and out-of-domain) at its
sampling settings, with `trainer.audits.pass_rate` (the trainer's own verifier, the one of the training
rewards), together with each trained model's KL to the base on its in-domain responses. Writes
`<out>/smol_gpu.md` and `<out>/smol_gpu.json`.

    python benchmarks/smol_gpu.py --model DIR --out OUT [--train-minutes 8] [--set train.lr=2e-5 ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sweep.study.checks import merge  # noqa: E402
from sweep.study.grid import load_study  # noqa: E402
from trainer.run import EXIT_PREEMPTED  # noqa: E402
from trainer.run_files import COMPLETE, read_metrics  # noqa: E402

log = logging.getLogger("smol_gpu")


def train(study, model: str, out: Path, extra: list[str], seconds: float, parallel: int) -> dict[str, int]:
    """Every run of the study that is not complete, `parallel` at a time (0: all at once), until each ends
    or `seconds` pass; then SIGTERM (a checkpoint, exit 75) to those still going. Exit statuses by run."""
    waiting = [run for run in study.runs if not (out / "runs" / run.run_id / COMPLETE).exists()]
    running: dict[str, subprocess.Popen] = {}
    codes: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    while (waiting or running) and time.monotonic() < deadline:
        while waiting and (not parallel or len(running) < parallel):
            run = waiting.pop(0)
            directory = out / "runs" / run.run_id
            directory.mkdir(parents=True, exist_ok=True)
            with (directory / "train.log").open("a") as handle:
                running[run.run_id] = subprocess.Popen(
                    [sys.executable, "-m", "trainer", "train", "--out", str(directory), *run.overrides(),
                     f"model.path={model}", *extra], cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                    env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        time.sleep(2)
        for name in [name for name, process in running.items() if process.poll() is not None]:
            codes[name] = running.pop(name).returncode
    for process in running.values():
        process.send_signal(signal.SIGTERM)
    for name, process in running.items():
        try:
            codes[name] = process.wait(timeout=240)
        except subprocess.TimeoutExpired:
            process.kill()
            codes[name] = process.wait()
    return codes


def trained_model(run_dir: Path) -> tuple[Path | None, int]:
    """A run's model to evaluate: final/ when complete, else its newest checkpoint's; and its steps."""
    if (run_dir / COMPLETE).exists():
        return run_dir / "final", json.loads((run_dir / COMPLETE).read_text())["steps"]
    steps = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
                   if p.name.removeprefix("step_").isdigit() and (p / "model" / "config.json").is_file())
    if not steps:
        return None, 0
    return run_dir / "checkpoints" / f"step_{steps[-1]}" / "model", steps[-1]


def evaluate(study, model: str, models: dict[str, Path | None], problems: int, device: str) -> list[dict]:
    """pass@1 of each model on each evaluation data set, and its in-domain KL to the base model."""
    import torch

    from eval.verify import Verifier
    from trainer.audits import pass_rate
    from trainer.model.models import load_model, load_tokenizer
    from trainer.rollout.base import SamplingParams
    from trainer.rollout.hf import HFEngine
    from trainer.tasks import make_task

    spec = study.evaluate
    chat = study.runs[0].config.get("model", {}).get("chat_template", False)
    params = SamplingParams(n=spec["samples"], temperature=spec["temperature"], top_p=spec["top_p"],
                            max_new_tokens=spec["max_gen_toks"] or 256)
    training_task = study.runs[0].config["task"]["name"]
    tokenizer = load_tokenizer(model)
    base = load_model(model, device=device).eval().requires_grad_(False)
    verifier = Verifier()
    rows = []
    try:
        for name, path in models.items():
            lm = base if path is None else load_model(str(path), device=device).eval().requires_grad_(False)
            engine = HFEngine(lm, tokenizer)
            row = {"model": name}
            for task_name, data_name in spec["data"].items():
                data = study.data[data_name]
                # the data set's problems, asked as its evaluation task asks them (arith_natural: in words)
                options = {**data["options"], "prompt": "natural" if task_name.endswith("_natural") else "toy"}
                task = make_task(data["task"], options)
                in_domain = data["task"] == training_task
                measured = pass_rate.measure(engine, tokenizer, task, options, min(problems, data["n"]),
                                             params, 0, chat, verifier,
                                             kl_between=(lm, base) if in_domain and path is not None else None)
                row[task_name] = measured.record()
                log.info("%s %s: pass@1 %.3f ± %.3f, KL %s, %.0f s", name, task_name, measured.pass_at_1,
                         measured.se, measured.kl, measured.seconds)
            rows.append(row)
            if path is not None:
                del lm, engine
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    finally:
        verifier.close()
    return rows


def table(rows: list[dict], tasks: list[str], steps: dict[str, int]) -> str:
    header = " | ".join(f"{t} pass@1 | ± se" for t in tasks)
    lines = [f"| model | steps | {header} | KL to base | tokens |", "|---" + "|---:" * (2 * len(tasks) + 3) + "|"]
    for row in rows:
        cells = " | ".join(f"{row[t]['pass_at_1']:.3f} | {row[t]['se']:.3f}" for t in tasks)
        kl = next((row[t]["kl"] for t in tasks if row[t].get("kl") is not None), 0.0)
        lines.append(f"| {row['model']} | {steps.get(row['model'], 0)} | {cells} | {kl:.4f} | "
                     f"{row[tasks[0]]['tokens']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, action="append",
                        help="study config; several are merged in order, as Snakemake merges --configfile "
                        "(default: workflow/config/smol.yaml, then benchmarks/smol_gpu.yaml)")
    parser.add_argument("--model", required=True, help="the imported SmolLM2 directory (python -m trainer import-gguf)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train-minutes", type=float, default=8.0,
                        help="then SIGTERM: checkpoint and stop (0: train nothing, evaluate what is there)")
    parser.add_argument("--evaluate-anyway", action="store_true", help="evaluate runs that are not complete, at "
                        "their newest checkpoint (their steps are in the table)")
    parser.add_argument("--parallel", type=int, default=0, help="runs training at once (default 0: all)")
    parser.add_argument("--eval-problems", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a run-config override for every run (after the study's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    merged: dict = {}
    for path in args.config or [REPO / "workflow" / "config" / "smol.yaml", REPO / "benchmarks" / "smol_gpu.yaml"]:
        merged = merge(merged, yaml.safe_load(path.read_text()))
    study = load_study(merged)
    args.out.mkdir(parents=True, exist_ok=True)  # also where nothing is trained: the summary goes there
    t0 = time.monotonic()
    if args.train_minutes > 0:
        codes = train(study, args.model, args.out, [f"model.device={args.device}", *args.set],
                      args.train_minutes * 60, args.parallel)
        log.info("training: %.0f s, exit statuses %s", time.monotonic() - t0, codes)
        failed = {name: code for name, code in codes.items() if code not in (0, EXIT_PREEMPTED)}
        if failed:
            log.error("runs failed: %s (see their train.log)", failed)
    trained = {run.run_id: trained_model(args.out / "runs" / run.run_id) for run in study.runs}
    progress = {}
    for name in trained:
        lines = read_metrics(args.out / "runs" / name / "metrics.jsonl") if (
            args.out / "runs" / name / "metrics.jsonl").exists() else []
        progress[name] = {"steps": len(lines), "checkpoint": trained[name][1],
                          "step_time": sum(m["step_time"] for m in lines) / max(1, len(lines)),
                          "reward": [round(m["reward_mean"], 3) for m in lines]}
        log.info("%s: %d steps, checkpoint %d, %.1f s a step", name, len(lines), trained[name][1],
                 progress[name]["step_time"])
    summary = {"train_seconds": time.monotonic() - t0, "progress": progress}
    incomplete = [name for name in trained if not (args.out / "runs" / name / COMPLETE).exists()]
    if incomplete and not args.evaluate_anyway:
        (args.out / "smol_gpu.json").write_text(json.dumps(summary, indent=1) + "\n")
        log.info("%d runs not complete: run the same command again to resume them (or --evaluate-anyway)",
                 len(incomplete))
        return 0
    t1 = time.monotonic()
    models = {"base": None, **{name: path for name, (path, _) in trained.items() if path is not None}}
    rows = evaluate(study, args.model, models, args.eval_problems, args.device)
    summary.update(eval_seconds=time.monotonic() - t1, rows=rows)
    (args.out / "smol_gpu.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = table(rows, list(study.evaluate["data"]), {name: steps for name, (_, steps) in trained.items()})
    (args.out / "smol_gpu.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
