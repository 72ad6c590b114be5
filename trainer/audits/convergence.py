"""Convergence audit: train tabular policies with sampled batches and measure where they end up.

The optimum of E[R] - beta KL(pi || pi_ref) is pi* ~ pi_ref exp(R / beta). A configuration whose
expected gradient is that objective's converges to pi*; a biased one converges elsewhere. Each
configuration trains from pi_ref on the same stream of random numbers, with Adam and a learning rate
that decays exponentially to `lr_floor` of its start so that the sampling noise dies down, and
KL(pi || pi*) is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.audits import tabular
from trainer.audits.tabular import one_thread
from trainer.objective import estimators
from trainer.objective.loss import ObjectiveConfig, compute_loss
from trainer.objective.placements import kl_placements
from trainer.progress import progress_bar


def on_policy_configs(beta: float, advantage: str) -> dict[str, ObjectiveConfig]:
    """The no-KL baseline and every registered estimator x placement, keyed by a readable label.
    (On-policy the sequence-level weights are exactly 1: they add no configuration here.)"""
    configs = {"none": ObjectiveConfig(placement="none", beta=beta, advantage=advantage)}
    for estimator in estimators.REGISTRY.names:
        for placement in kl_placements():
            configs[f"{estimator} {placement}"] = ObjectiveConfig(
                estimator=estimator, placement=placement, beta=beta, advantage=advantage)
    return configs


def unbiased_labels() -> set[str]:
    """The configurations whose expected gradient is grad KL(pi || pi_ref) (the registered theory)."""
    return {f"{spec.name} {placement}" for spec in estimators.REGISTRY
            for (placement, ratio), verdict in spec.theory.items() if ratio == "none" and verdict == "unbiased"}


@dataclass(frozen=True)
class ConvergenceAudit:
    steps: list[int]
    curves: dict[str, list[float]]
    setup: dict[str, object] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, float]:
        return {label: curve[-1] for label, curve in self.curves.items()}


def convergence_audit(vocab: int = 3, length: int = 2, group_size: int = 4, groups_per_step: int = 32,
                      steps: int = 1000, beta: float = 0.3, lr: float = 0.1, lr_floor: float = 1e-3, seed: int = 0,
                      eval_every: int = 10, advantage: str = "rloo",
                      progress: bool | None = None) -> ConvergenceAudit:
    """Train one tabular policy per configuration; record KL(pi || pi*) every `eval_every` steps."""
    if steps < 1 or eval_every < 1:
        raise ValueError(f"steps and eval_every must be >= 1, got {steps} and {eval_every}")
    space = tabular.SequenceSpace(vocab, length)
    gen = torch.Generator().manual_seed(seed)
    ref_logits = space.random_logits(gen)
    rewards = torch.rand(space.n_sequences, generator=gen, dtype=torch.float64)
    target = tabular.optimum_logp(space, ref_logits, rewards, beta)
    ref_token_logp = space.token_logp(ref_logits)
    batch = group_size * groups_per_step
    mask = torch.ones(batch, length, dtype=torch.float64)
    configs = on_policy_configs(beta, advantage)
    eval_steps = [s for s in range(steps + 1) if s % eval_every == 0 or s == steps]
    curves: dict[str, list[float]] = {}
    bar = progress_bar(len(configs) * steps, "convergence audit", progress)
    with one_thread():  # tiny tensors: intra-op threads only contend
        for label, config in configs.items():
            theta = ref_logits.clone().requires_grad_(True)
            optimizer = torch.optim.Adam([theta], lr=lr)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_floor ** (s / steps))
            sampler = torch.Generator().manual_seed(seed + 1)
            curve = []
            for step in range(steps + 1):
                if step in eval_steps:
                    with torch.no_grad():
                        curve.append(float(tabular.sequence_kl(space, theta, target)))
                if step == steps:
                    break
                token_logp = space.token_logp(theta)
                with torch.no_grad():
                    probs = token_logp.sum(-1).exp()
                    rows = torch.multinomial(probs, batch, replacement=True, generator=sampler)
                token_kl = space.token_kl(theta, ref_logits)[rows] if config.needs_full_kl else None
                loss, _ = compute_loss(token_logp[rows], ref_token_logp[rows], None, rewards[rows], mask,
                                       group_size, config, token_kl=token_kl, stats=False)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                bar.update()
            curves[label] = curve
    bar.close()
    setup = {"vocab": vocab, "length": length, "group_size": group_size, "groups_per_step": groups_per_step,
             "steps": steps, "beta": beta, "lr": lr, "lr_floor": lr_floor, "seed": seed, "advantage": advantage,
             "start_kl_to_optimum": curves["none"][0]}
    return ConvergenceAudit(eval_steps, curves, setup)


def convergence_table_markdown(audit: ConvergenceAudit) -> str:
    """Final KL(pi || pi*) per configuration, smallest first."""
    s = audit.setup
    lines = [
        f"Convergence audit: vocabulary {s['vocab']}, length {s['length']}, {s['groups_per_step']} groups of "
        f"{s['group_size']} per step, {s['steps']} steps, beta {s['beta']}, advantage {s['advantage']}, "
        f"seed {s['seed']}. Every policy starts at pi_ref, KL(pi_ref || pi*) = {s['start_kl_to_optimum']:.3g}.",
        "",
        "| configuration | final KL(pi || pi*) |",
        "|---|---:|",
    ]
    for label, value in sorted(audit.final.items(), key=lambda item: item[1]):
        lines.append(f"| {label} | {max(value, 0.0):.2e} |")  # KL >= 0; below 0 is rounding
    return "\n".join(lines)


PLOT_FLOOR = 1e-10


def plot_convergence(audit: ConvergenceAudit, path: Path) -> Path:
    """A PNG of KL(pi || pi*) over steps, one line per configuration (log scale).

    Values below PLOT_FLOOR (k1-reward reaches pi* to rounding error, where KL can even come out
    a hair below zero) are drawn at the floor.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unbiased = unbiased_labels()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for label, curve in audit.curves.items():
        style = "-" if label in unbiased else ("--" if label != "none" else ":")
        ax.plot(audit.steps, [max(v, PLOT_FLOOR) for v in curve], style, label=label, linewidth=1.6)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"KL(pi || pi*)  (floored at {PLOT_FLOOR:g})")
    s = audit.setup
    ax.set_title(f"Distance to the regularised optimum (tabular, V={s['vocab']}, T={s['length']}, beta={s['beta']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
