"""The search for a toy study in which RL learns: candidate toys, one run each.

A candidate is a reference (the toy Llama, SFT-warmed for some steps on a task) and a training
recipe (batch, learning rate, steps, beta). Each is trained as one k1-reward run (the last four:
k3-reward and k1-loss, for the known effects at larger betas) and measured as
the toy study measures its runs (`measure`: 100 held-out prompts x 16 samples): the held-out reward
against the reference's, the KL to the reference, and the objective gap J* - J(pi) against the
reference's own gap. The markdown table it prints is docs/results/toy_design.md's; a single seed
per row, so read differences below about 0.05 in the gap ratio as noise.

    python benchmarks/toy_design.py [--only NAME ...] [--jobs 2] [--work DIR]

Two candidates train side by side (`--jobs`), one thread each. References are built once per
(model, SFT) pair under --work and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.run_files import METRICS, OBJECTIVE, read_metrics  # noqa: E402

PLUS = {"max_operand": 9, "ops": "+"}
PLUS_MINUS = {"max_operand": 9, "ops": "+-"}


@dataclass(frozen=True)
class Candidate:
    name: str
    note: str
    sft_steps: int = 120
    task: dict = field(default_factory=lambda: PLUS)
    steps: int = 120
    prompts: int = 64
    group: int = 8
    lr: float = 1e-3
    beta: float = 0.1
    seed: int = 0
    extra: tuple[str, ...] = ()       # further run-config overrides (section.key=value)
    model: tuple[str, ...] = ()       # toy-model options (--hidden-size 64 ...)

    def overrides(self) -> list[str]:
        options = json.dumps(self.task)
        return [f"task.options={options}", f"measure.task_options={json.dumps({**self.task, 'seed': 1})}",
                f"train.steps={self.steps}", f"train.prompts_per_step={self.prompts}",
                f"train.group_size={self.group}", f"train.lr={self.lr}", f"objective.beta={self.beta}",
                f"train.seed={self.seed}", *self.extra]


OLD = {"sft_steps": 300, "task": PLUS_MINUS}      # the earlier toy study: +/- up to 9, 300 SFT steps

CANDIDATES = [
    # The old toy: a strong reference (0.63 sampled, 0.99 greedy) that RL can only sharpen.
    Candidate("old", "the old main job's recipe", **OLD, steps=60, prompts=32, lr=3e-4),
    Candidate("old-lr1e-3", "larger steps on noisy gradients", **OLD, prompts=32),
    Candidate("old-lr3e-3", "a still larger lr", **OLD, prompts=32, lr=3e-3, extra=("train.warmup_steps=20",)),
    Candidate("old-64x8", "twice the batch", **OLD),
    Candidate("old-128x8", "four times the batch", **OLD, prompts=128),
    Candidate("old-128x8-lr2e-3", "the large batch, a larger lr, half the steps", **OLD, prompts=128, lr=2e-3,
              steps=60),
    # Weaker references on the old task: room to learn, but facts to learn one by one.
    Candidate("pm-sft120", "+/- reference at 120 SFT steps", sft_steps=120, task=PLUS_MINUS, prompts=32),
    Candidate("pm-sft120-lr3e-3", "the weak +/- reference, a larger lr", sft_steps=120, task=PLUS_MINUS,
              prompts=32, lr=3e-3, extra=("train.warmup_steps=20",)),
    Candidate("pm-sft180-32x16", "a +/- reference at 0.31, groups of 16", sft_steps=180, task=PLUS_MINUS,
              prompts=32, group=16),
    Candidate("op4-sft60", "+/- up to 4 (50 problems)", sft_steps=60, task={"max_operand": 4, "ops": "+-"},
              prompts=32),
    # Addition only (100 problems), a weak reference (0.32 sampled).
    Candidate("plus-32x8", "addition, batch of the old toy", prompts=32),
    Candidate("plus-32x8-200", "longer at the old batch", prompts=32, steps=200),
    Candidate("plus-sft100-32x8-200", "weaker reference (0.22)", sft_steps=100, prompts=32, steps=200),
    Candidate("plus-sft150", "stronger reference (0.44)", sft_steps=150),
    Candidate("plus-64x8-80", "twice the batch, 80 steps", steps=80),
    Candidate("plus-64x8-lr1.5e-3-80", "a larger lr, 80 steps", steps=80, lr=1.5e-3),
    Candidate("plus-128x4-lr1.5e-3-80", "more prompts, smaller groups", steps=80, prompts=128, group=4, lr=1.5e-3),
    Candidate("plus-64x8", "addition, 64 prompts x 8", steps=120),
    Candidate("plus-64x8-seed1", "seed 1: the noise of a row", steps=120, seed=1),
    Candidate("plus-64x8-cosine", "cosine decay to 0", extra=("train.lr_schedule=cosine",)),
    Candidate("plus-64x8-cosine-lr2e-3", "cosine from a larger lr", lr=2e-3, extra=("train.lr_schedule=cosine",)),
    Candidate("plus-64x8-mlp128", "half the MLP (24% faster steps)", model=("--intermediate-size", "128")),
    Candidate("plus-64x8-160", "longer", steps=160),
    Candidate("plus-64x8-200", "longer still", steps=200),
    Candidate("plus-64x8-b0.3", "beta 0.3", beta=0.3),
    Candidate("plus-64x8-b1", "beta 1", beta=1.0),
    Candidate("plus-64x8-b1-160", "beta 1, longer", beta=1.0, steps=160),
    Candidate("chosen", "the toy study's recipe (150 steps)", steps=150),
    # Not k1-reward: how the known effects show at the larger betas of this design.
    Candidate("plus-64x8-b1-k3-reward", "k3 in the reward, beta 1", beta=1.0, extra=("objective.estimator=k3",)),
    Candidate("plus-64x8-b1-k1-loss", "k1 in the loss, beta 1", beta=1.0, extra=("objective.placement=loss",)),
    Candidate("plus-64x8-b0.3-k3-reward", "k3 in the reward, beta 0.3", beta=0.3, extra=("objective.estimator=k3",)),
    Candidate("plus-64x8-b0.3-k1-loss", "k1 in the loss, beta 0.3", beta=0.3, extra=("objective.placement=loss",)),
]


def trainer_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` in a child of one thread (two candidates share 2 cores), output captured."""
    return subprocess.run([sys.executable, "-m", "trainer", *args], check=check, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def build_reference(c: Candidate, work: Path) -> Path:
    """The toy Llama SFT-warmed as the candidate says; built once per (model, SFT) and reused."""
    shape = "".join(c.model).replace("-", "")
    task = "_".join(f"{k}{v}".replace("+", "plus").replace("-", "minus") for k, v in sorted(c.task.items()))
    out = work / "models" / f"random{shape}_sft{c.sft_steps}_{task}"
    if (out / "config.json").exists():
        return out
    base = work / "models" / f"random{shape}"
    if not (base / "config.json").exists():
        trainer_cli("toy-model", "--out", str(base), *c.model)
    options = [f"--option={k}={v}" for k, v in c.task.items()]
    trainer_cli("sft", "--model", str(base), "--steps", str(c.sft_steps), *options, "--out", str(out))
    return out


def run(c: Candidate, work: Path) -> dict:
    reference = build_reference(c, work)
    out = work / "runs" / c.name
    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    done = trainer_cli(
        "train", "--out", str(out), f"model.path={reference}",
        "objective.estimator=k1", "objective.placement=reward", "objective.advantage=rloo",
        "rollout.max_new_tokens=4", 'rollout.stop=["\\n"]', "train.warmup_steps=10",
        "train.adam_betas=[0.9, 0.99]", "checkpoint.every=1000", "measure.prompts=100", "measure.samples=16",
        "measure.reference_samples=64", *c.overrides(), check=False)
    if done.returncode:
        raise RuntimeError(f"{c.name}: the run failed:\n{done.stderr[-2000:]}")
    metrics = read_metrics(out / METRICS)
    measured = read_metrics(out / OBJECTIVE)[-1]
    first = sum(m["reward_mean"] for m in metrics[:10]) / 10
    last = sum(m["reward_mean"] for m in metrics[-10:]) / 10
    return {"candidate": c, "reference_reward": measured["reference_reward"], "reward": measured["reward"],
            "kl": measured["kl"], "gap": measured["gap"], "reference_gap": measured["reference_gap"],
            "train_first": first, "train_last": last,
            "step_s": sum(m["step_time"] for m in metrics) / len(metrics), "wall_s": time.monotonic() - start}


def table(rows: list[dict]) -> str:
    lines = ["| candidate | what it tries | reference (SFT steps, task) | batch x steps, lr, beta | reference reward | "
             "held-out reward (change) | KL | gap / reference's gap | training reward, first 10 -> last 10 | "
             "s per step |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["candidate"]
        task = "+" if c.task.get("ops") == "+" else "+/-"
        task += f" to {c.task['max_operand']}"
        model = " " + " ".join(c.model) if c.model else ""
        lines.append(
            f"| {c.name} | {c.note} | {c.sft_steps}, {task}{model} | "
            f"{c.prompts}x{c.group} x {c.steps}, {c.lr:g}, {c.beta:g}"
            f"{', ' + ', '.join(e.split('.')[-1] for e in c.extra) if c.extra else ''} | "
            f"{r['reference_reward']:.3f} | {r['reward']:.3f} ({r['reward'] - r['reference_reward']:+.3f}) | "
            f"{r['kl']:.3f} | {r['gap']:.3f} / {r['reference_gap']:.3f} = **{r['gap'] / r['reference_gap']:.2f}** | "
            f"{r['train_first']:.3f} -> {r['train_last']:.3f} | {r['step_s']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="candidate names (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="candidates trained at once, one thread each")
    parser.add_argument("--work", type=Path, help="where references and runs go (default: a temporary dir)")
    args = parser.parse_args()
    chosen = [c for c in CANDIDATES if not args.only or c.name in args.only]
    unknown = set(args.only or ()) - {c.name for c in CANDIDATES}
    if unknown:
        parser.error(f"--only: no candidate {', '.join(sorted(unknown))}; "
                     f"choose from {', '.join(c.name for c in CANDIDATES)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="toy-design-"))
    # References first, one at a time: two candidates must not build the same one at once.
    for c in chosen:
        build_reference(c, work)
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = []
        for row in pool.map(lambda c: run(c, work), chosen):
            rows.append(row)
            print(f"{row['candidate'].name}: gap ratio {row['gap'] / row['reference_gap']:.2f}", file=sys.stderr,
                  flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
