"""What a configuration optimises, as a whole: its expected gradient split into the reward's and the KL's parts.

The KL part of a gradient, (E[grad loss] - E[grad loss without the KL]) / beta, says whether the KL term is
grad KL; it cannot say what happens when the KL term and the reward's term are scaled by different factors, or
by one that depends on both: an advantage that centres R but not the KL (drgrpo with the KL to go), one that
centres both (reward-centred), or one that divides both by a batch statistic (whitening). Here the whole expected
gradient g of the loss is projected, by least squares, on the two directions an exact objective E[R] - beta KL
has,

    g = a (-grad E[R]) + b grad KL(pi || pi_ref) + r,

and a configuration optimises E[R] - beta_eff KL with beta_eff = b / a, at a learning rate scaled by a, exactly
when the residual r is 0 (bias = |r| / |g|). Computed exactly, by enumeration, through `compute_loss`
(`trainer.audits.enumeration.expected_gradient`).

`whitening_audit`: each whitening advantage next to the one it whitens, with the KL where the PPO-style libraries
put it (to go, each token's own, summed), on-policy: the rows `python -m trainer audit --presets` prints under
the presets.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.audits import tabular
from trainer.audits.enumeration import AuditInstance, expected_gradient, target_gradients
from trainer.objective.objective_config import ObjectiveConfig
from trainer.progress import progress_bar


@dataclass(frozen=True)
class Coefficients:
    reward: float  # a: the weight on -grad E[R]
    kl: float      # b: the weight on grad KL(pi || pi_ref)
    bias: float    # |r| / |g|: the part of the gradient neither direction explains

    @property
    def beta_eff(self) -> float:
        return self.kl / self.reward if self.reward else float("nan")


def decompose(grad: Tensor, targets: dict[str, Tensor]) -> Coefficients:
    """Least squares of the loss's expected gradient on -grad E[R] and grad KL (`enumeration.target_gradients`)."""
    columns = torch.stack([-targets["reward"].flatten(), targets["unbiased"].flatten()], dim=1)
    flat = grad.flatten()
    solution = torch.linalg.lstsq(columns, flat.unsqueeze(-1)).solution.squeeze(-1)
    residual = flat - columns @ solution
    norm = float(flat.norm())
    return Coefficients(float(solution[0]), float(solution[1]), float(residual.norm()) / norm if norm else 0.0)


def objective_verdict(c: Coefficients, beta: float, tol: float) -> str:
    """exact: E[R] - beta KL itself (at a learning rate scaled by a); rescaled: E[R] - beta_eff KL with another
    beta; no regularization: E[R] alone; biased: no objective of that form."""
    if c.bias > tol:
        return "biased"
    if abs(c.beta_eff) <= tol * beta:
        return "no regularization"
    return "exact" if abs(c.beta_eff - beta) <= tol * beta else "rescaled"


@dataclass(frozen=True)
class CoefficientRow:
    advantage: str
    estimator: str
    placement: str
    reward_weight: float  # a, median over seeds
    beta_ratio: float     # beta_eff / beta, median over seeds
    beta_ratio_min: float  # and its range: a biased configuration's best fit moves with the instance
    beta_ratio_max: float
    bias: float           # worst over seeds
    verdict: str


WHITENING_PAIRS = (("reinforce", "reinforce-whiten"), ("reinforce", "reinforce-whiten-pop"),
                   ("drgrpo", "drgrpo-whiten"), ("drgrpo", "drgrpo-whiten-pop"))
WHITENING_PLACEMENTS = (("k1", "reward-to-go"), ("k1", "reward"), ("k3", "reward-token"), ("k1", "reward-token"))


def whitening_configs() -> list[tuple[str, str, str]]:
    """(advantage, estimator, placement): each base advantage and its whitening variants, with the KL as the peers
    place it (verl, OpenRLHF and slime to go; verl's REINFORCE++-baseline summed; NeMo-RL each token's own, k3)."""
    advantages = list(dict.fromkeys(name for pair in WHITENING_PAIRS for name in pair))
    return [(a, e, p) for e, p in WHITENING_PLACEMENTS for a in advantages]


def coefficient_rows(configs: list[tuple[str, str, str]], vocab: int = 3, length: int = 2, group_size: int = 2,
                     seeds: tuple[int, ...] = (0, 1, 2), beta: float = 0.1, tol: float = 1e-6,
                     progress: bool | None = None, batch_groups: int = 1) -> list[CoefficientRow]:
    """Each (advantage, estimator, placement), on-policy, decomposed on every seed; each loss is of a batch of
    `batch_groups` groups."""
    groups = tabular.SequenceSpace(vocab, length).groups(group_size * batch_groups)
    found: dict[tuple[str, str, str], list[Coefficients]] = {c: [] for c in configs}
    bar = progress_bar(len(seeds) * len(configs), "coefficients audit", progress)
    for seed in seeds:
        inst = AuditInstance.random(vocab, length, seed)
        targets = target_gradients(inst)
        for key in configs:
            advantage, estimator, placement = key
            config = ObjectiveConfig(estimator=estimator, placement=placement, beta=beta, advantage=advantage,
                                     reward_kl="current")
            grad = expected_gradient(inst, config, group_size, False, groups, batch_groups=batch_groups)
            found[key].append(decompose(grad, targets))
            bar.update()
    bar.close()
    rows = []
    for (advantage, estimator, placement), results in found.items():
        ratios = [c.beta_eff / beta for c in results]
        verdicts = {objective_verdict(c, beta, tol) for c in results}
        rows.append(CoefficientRow(advantage, estimator, placement, statistics.median(c.reward for c in results),
                                   statistics.median(ratios), min(ratios), max(ratios), max(c.bias for c in results),
                                   verdicts.pop() if len(verdicts) == 1 else "mixed"))
    return rows


WHITENING_SETUP = {"vocab": 2, "length": 2, "group_size": 2, "batch_groups": 2}


def whitening_audit(seeds: tuple[int, ...] = (0, 1, 2), beta: float = 0.1, tol: float = 1e-6,
                    progress: bool | None = None, **setup: int) -> list[CoefficientRow]:
    """The whitening rows on batches of two groups (so that a group's baseline and the batch's mean differ), of
    WHITENING_SETUP's size unless `setup` says otherwise: 256 batches per instance at its defaults."""
    s = {**WHITENING_SETUP, **setup}
    return coefficient_rows(whitening_configs(), s["vocab"], s["length"], s["group_size"], seeds, beta, tol,
                            progress, s["batch_groups"])


def coefficients_markdown(rows: list[CoefficientRow], setup: dict[str, object]) -> str:
    lines = [
        f"Whitening, exactly: vocabulary {setup['vocab']}, length {setup['length']}, batches of "
        f"{setup.get('batch_groups', 1)} groups of {setup['group_size']} (whitened over the batch's "
        f"{setup.get('batch_groups', 1) * setup['group_size'] * setup['length']} tokens), beta {setup['beta']}, "
        f"seeds {setup['seeds']}, on-policy, every batch enumerated. The expected gradient of the loss, projected on "
        "-grad E[R] and grad KL(pi || pi_ref): g = a (-grad E[R]) + b grad KL + r. a: the reward's weight (a "
        "learning-rate factor); beta_eff / beta = (b / a) / beta, the KL's effective coefficient against the one "
        "configured (a and it: the median over seeds, and its range); bias: |r| / |g| (worst seed). exact: "
        "E[R] - beta KL; rescaled: E[R] - beta_eff KL; no regularization: E[R] alone; biased: no objective of "
        "that form (beta_eff is then only the best fit, and moves with the instance).",
        "",
        "| advantage | estimator | placement | a | beta_eff / beta | its range over seeds | bias | verdict |",
        "|---|---|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r.advantage} | {r.estimator} | {r.placement} | {r.reward_weight:.3f} | {r.beta_ratio:.3f} "
                     f"| {r.beta_ratio_min:.2f} to {r.beta_ratio_max:.2f} | {r.bias:.1e} | {r.verdict} |")
    return "\n".join(lines)
