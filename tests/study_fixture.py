"""Synthetic run and eval directories with known numbers (no training needed)."""

import json
from pathlib import Path

import yaml

REFERENCE_HISTOGRAMS = [[[0.0, 1], [1.0, 1]], [[0.0, 3], [1.0, 1]]]  # two prompts: pass rates 0.5 and 0.25


def write_run(results: Path, run_id: str, estimator: str, placement: str, beta: float, seed: int,
              rewards: list[float], scores: dict[str, float], model: str = "toy", complete: bool = True,
              skipped: int = 0, measured: tuple[list[float], list[float]] | None = None,
              train: dict | None = None, objective: dict | None = None) -> Path:
    """A run with `rewards` per step and eval `scores`; with `measured` (per-prompt reward and KL of the
    final model), also its objective.jsonl and the reference's histograms of REFERENCE_HISTOGRAMS;
    `train` and `objective`: more of those sections' config (an extra axis's value)."""
    run = results / "runs" / run_id
    run.mkdir(parents=True, exist_ok=True)
    config = {"model": {"path": f"/models/{model}"}, "objective": {"estimator": estimator, "placement": placement,
              "beta": beta, **(objective or {})}, "train": {"seed": seed, "steps": len(rewards), **(train or {})}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    lines = [{"step": i, "reward_mean": r, "pass_rate": r, "kl_k3": 0.01 * i, "entropy": 1.0 - 0.01 * i,
              "response_length": 3.0, "skipped_updates": float(skipped if i == 1 else 0)}
             for i, r in enumerate(rewards)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if complete:
        (run / "COMPLETE").write_text("{}\n")
    if measured is not None:
        from trainer.measure.objective import summarize

        line = summarize(len(rewards), None if placement == "none" else beta, REFERENCE_HISTOGRAMS,
                         {"reward": measured[0], "kl": measured[1]}, samples=4)  # as training writes it
        (run / "objective.jsonl").write_text(json.dumps(line) + "\n")
        (run / "objective_reference.json").write_text(json.dumps({"histograms": REFERENCE_HISTOGRAMS}))
    suite = results / "eval" / run_id / "all"
    suite.mkdir(parents=True, exist_ok=True)
    tasks = {t: {"metric": "pass@1", "value": v, "stderr": 0.01, "n": 100} for t, v in scores.items()}
    (suite / "metrics.json").write_text(json.dumps({"tasks": tasks}))
    (suite / "samples.jsonl").write_text(json.dumps({"task": "math500", "doc_id": 0}) + "\n")
    return run


def write_study(results: Path) -> Path:
    """k1-reward and k3-loss at beta 0.05 (two seeds each) and a no-KL baseline."""
    write_run(results, "toy__k1-reward__b0.05__s0", "k1", "reward", 0.05, 0, [0.2, 0.4, 0.6, 0.8], {"math500": 0.5})
    write_run(results, "toy__k1-reward__b0.05__s1", "k1", "reward", 0.05, 1, [0.2, 0.4, 0.6, 0.8], {"math500": 0.7})
    write_run(results, "toy__k3-loss__b0.05__s0", "k3", "loss", 0.05, 0, [0.2, 0.8, 0.1, 0.05], {"math500": 0.2},
              skipped=1)
    write_run(results, "toy__k3-loss__b0.05__s1", "k3", "loss", 0.05, 1, [0.2, 0.4, 0.5, 0.5], {"math500": 0.4})
    write_run(results, "toy__none__s0", "k1", "none", 0.0, 0, [0.2, 0.3, 0.3, 0.3], {"math500": 0.6})
    return results


def write_offpolicy_study(results: Path) -> Path:
    """k1-reward, k1-loss with the KL loss ratio none and detached, and no KL, at async levels 0 and 2,
    two seeds each; pass@1 and the measured objective are known per run."""
    for seed in (0, 1):
        for level in (0, 2):
            tag = "" if level == 0 else "__async2"
            stale = 0.1 * level  # staleness costs k1-loss without the ratio
            write_run(results, f"toy__k1-reward__b0.1{tag}__s{seed}", "k1", "reward", 0.1, seed, [0.5, 0.6],
                      {"arith": 0.6 + 0.01 * seed}, train={"async_level": level}, objective={"kl_loss_ratio": "none"},
                      measured=([0.7, 0.4], [0.1, 0.1]))
            for ratio in ("none", "detached"):
                part = "" if ratio == "none" else "__ratio-detached"
                drop = stale if ratio == "none" else 0.0
                write_run(results, f"toy__k1-loss__b0.1{part}{tag}__s{seed}", "k1", "loss", 0.1, seed, [0.5, 0.6],
                          {"arith": 0.55 - drop + 0.01 * seed}, train={"async_level": level},
                          objective={"kl_loss_ratio": ratio}, measured=([0.7 - drop, 0.4], [0.2 + drop, 0.2]))
            write_run(results, f"toy__none{tag}__s{seed}", "k1", "none", 0.0, seed, [0.5, 0.6 - stale],
                      {"arith": 0.5 - stale}, train={"async_level": level}, measured=([0.6, 0.4], [0.5, 0.5]))
    return results
