"""Exact audit of what each KL configuration of `compute_loss` really optimises.

Gradient audit: on random tabular policies, the expected gradient of `compute_loss` itself is
computed exactly, by enumerating every group of samples and weighting it by its probability under
the sampling policy (`trainer.audits.enumeration`). The KL part of that gradient,
(E[grad loss] - E[grad loss with no KL]) / beta, is compared with the gradients of the sequence
reverse KL and of the per-prefix reverse and forward KLs, and given a verdict.

Convergence audit: tabular policies trained from sampled batches with each configuration, and their
distance KL(pi || pi*) to the regularised optimum pi* ~ pi_ref exp(R / beta) over the steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from torch import Tensor

from trainer.audits import tabular
from trainer.audits.enumeration import (
    AuditInstance,
    cosine,
    expectation,
    group_gradients,
    rel_error,
    target_gradients,
    variance,
)
from trainer.objective import estimators, placements
from trainer.objective.loss import ObjectiveConfig
from trainer.objective.placements import kl_placements
from trainer.progress import progress_bar


def theory_on_policy(estimator: str, placement: str, ratio: str) -> str:
    """The theory's statement (docs/concepts/theory.md, "What each configuration differentiates";
    docs/full_kl.md derives full's), on-policy, for responses longer than one token, as the estimator
    registers it; '' where it states nothing."""
    return estimators.REGISTRY[estimator].theory.get((placement, ratio), "")


TARGETS = ("unbiased", "per-prefix reverse", "per-prefix forward")


def verdict(kl_grad: Tensor, targets: dict[str, Tensor], tol: float) -> str:
    """Every target the KL gradient matches to relative error `tol`, joined by ' = '.

    'zero' when its norm is below tol times that of the true KL gradient; 'scaled' when it is c grad KL
    with c > 0 other than 1 (the KL's coefficient is c beta: e.g. a baseline that is the group's mean,
    the response's own KL included), 'scaled per-prefix ...' the same of a per-prefix KL (a KL loss
    averaged over a response's tokens); 'biased' when it matches nothing.
    """
    if float(kl_grad.norm()) <= tol * float(targets["unbiased"].norm()):
        return "zero"
    matched = [name for name in TARGETS if rel_error(kl_grad, targets[name]) <= tol]
    if matched:
        return " = ".join(matched)
    for name in TARGETS:
        target = targets[name].flatten()
        scale = float((kl_grad.flatten() @ target) / (target @ target))
        if scale > 0 and rel_error(kl_grad, scale * targets[name]) <= tol:
            return "scaled" if name == "unbiased" else f"scaled {name}"
    return "biased"


@dataclass(frozen=True)
class GradientRow:
    """One configuration's KL-gradient statistics, aggregated over the audited seeds."""

    sampling: str
    estimator: str
    placement: str
    kl_loss_ratio: str
    pg_ratio: str
    norm_ratio: float
    cos_kl: float
    err_kl: float
    cos_prefix_reverse: float
    err_prefix_reverse: float
    cos_prefix_forward: float
    err_prefix_forward: float
    err_on_policy: float
    var_grad: float  # trace of the covariance of one group's sampled gradient (mean over seeds)
    var_kl: float    # the same of its KL part, (grad loss - grad loss without KL) / beta
    verdict: str
    theory: str

    @property
    def agrees(self) -> bool | None:
        """Whether the verdict contains the theory's (None where the theory table says nothing)."""
        if not self.theory:
            return None
        return self.theory in self.verdict.split(" = ")


def _in_loss(placement: str) -> bool:
    return placements.REGISTRY[placement].in_loss


def audit_configs(only_estimators: tuple[str, ...] | None = None, only_placements: tuple[str, ...] | None = None
                  ) -> list[tuple[str, str, str, str, str]]:
    """(sampling, estimator, placement, kl_loss_ratio, pg_ratio) for every audited configuration (of the
    given estimators and placements only, when given).

    The KL-loss weighting only matters for placements with a KL loss. On-policy the detached and
    sequence weights are exactly the unweighted loss (tested), so only the differentiable one gets
    rows there. Off-policy, the token-level weightings with PPO's token ratios (what the libraries
    do), then the sequence-level ones: the sequence ratio on the policy gradient and the prefix
    ratio on each KL-loss token.
    """
    rows = []
    names = [e for e in estimators.REGISTRY.names if only_estimators is None or e in only_estimators]
    with_kl = [p for p in kl_placements() if only_placements is None or p in only_placements]
    for estimator in names:
        for placement in with_kl:
            ratios = ("none", "differentiable") if _in_loss(placement) else ("none",)
            rows.extend(("on-policy", estimator, placement, ratio, "token") for ratio in ratios)
    for estimator in names:
        for placement in with_kl:
            ratios = ("none", "detached", "differentiable") if _in_loss(placement) else ("none",)
            rows.extend(("off-policy", estimator, placement, ratio, "token") for ratio in ratios)
    for estimator in names:
        for placement in with_kl:
            rows.append(("off-policy", estimator, placement, "sequence" if _in_loss(placement) else "none",
                         "sequence"))
    return rows


def theory_of(sampling: str, estimator: str, placement: str, ratio: str, pg_ratio: str, length: int) -> str:
    """The theory's verdict for a row ('' where it says nothing): the on-policy table, which the
    sequence-level weights make hold off-policy too (docs/concepts/theory.md, "What is exactly
    unbiased off-policy")."""
    if length < 2:
        return ""
    if sampling == "on-policy":
        return theory_on_policy(estimator, placement, ratio)
    if placements.REGISTRY[placement].centred:  # centred by the sampler's KL: not the on-policy statement
        return ""
    if pg_ratio == "sequence" and (not _in_loss(placement) or ratio == "sequence"):
        return theory_on_policy(estimator, placement, "none")
    return ""


@dataclass(frozen=True)
class GradientAudit:
    """The gradient audit's result: one row per configuration, and the policy-gradient checks."""

    rows: list[GradientRow]
    pg_error: dict[str, float]
    setup: dict[str, object]
    pg_variance: dict[str, float]  # the variance of one group's gradient without KL (mean over seeds)


def gradient_audit(vocab: int = 3, length: int = 2, group_size: int = 2, seeds: tuple[int, ...] = (0, 1, 2),
                   beta: float = 0.1, advantage: str = "rloo", tol: float = 1e-6,
                   progress: bool | None = None, clip_ratio_c: float | None = None,
                   only_estimators: tuple[str, ...] | None = None,
                   only_placements: tuple[str, ...] | None = None) -> GradientAudit:
    """Run the exact gradient audit for every configuration (of the given estimators and placements, when
    given) on every seed (with `clip_ratio_c`, under the dual clip: what it changes shows in the off-policy
    rows)."""
    # The reward's KL from the policy being differentiated, pi, in every row: the rows then differ only in
    # their importance weights. (From mu, the trainer's default off-policy, the reward term gains exactly
    # -grad KL(pi || mu): tests/test_kl_identities.py.)
    base = ObjectiveConfig(placement="none", beta=beta, advantage=advantage, clip_ratio_c=clip_ratio_c,
                           reward_kl="current")
    bases = {"token": base, "sequence": replace(base, pg_ratio="sequence", clip_ratio_c=None)}  # no token clip
    configs = audit_configs(only_estimators, only_placements)
    per_config: dict[tuple, list[dict[str, object]]] = {c: [] for c in configs}
    samplings = {"on-policy": ("on-policy", "token"), "off-policy": ("off-policy", "token"),
                 "off-policy, sequence ratio": ("off-policy", "sequence")}
    pg_errors: dict[str, list[float]] = {name: [] for name in samplings}
    pg_variances: dict[str, list[float]] = {name: [] for name in samplings}
    space = tabular.SequenceSpace(vocab, length)
    groups = space.groups(group_size)
    bar = progress_bar(len(seeds) * (len(configs) + len(samplings)), "gradient audit", progress)
    for seed in seeds:
        inst = AuditInstance.random(vocab, length, seed)
        targets = target_gradients(inst)
        baseline, baseline_groups = {}, {}
        for name, key in samplings.items():
            grads, weights = group_gradients(inst, bases[key[1]], group_size, key[0] == "off-policy", groups)
            baseline[key], baseline_groups[key] = expectation(grads, weights), grads
            pg_errors[name].append(rel_error(baseline[key], -targets["reward"]))
            pg_variances[name].append(variance(grads, weights))
            bar.update()
        kl_grads: dict[tuple[str, str, str, str, str], Tensor] = {}
        for config_key in configs:  # on-policy keys come first: off-policy rows compare with them
            sampling, estimator, placement, ratio, pg_ratio = config_key
            config = replace(bases[pg_ratio], estimator=estimator, placement=placement, kl_loss_ratio=ratio)
            grads, weights = group_gradients(inst, config, group_size, sampling == "off-policy", groups)
            kl_grad = kl_grads[config_key] = (expectation(grads, weights) - baseline[sampling, pg_ratio]) / beta
            on_policy_key = ("on-policy", estimator, placement,
                             "none" if ratio in ("detached", "sequence") else ratio, "token")
            per_config[config_key].append({
                "norm_ratio": float(kl_grad.norm() / targets["unbiased"].norm()),
                "cos_kl": cosine(kl_grad, targets["unbiased"]),
                "err_kl": rel_error(kl_grad, targets["unbiased"]),
                "cos_prefix_reverse": cosine(kl_grad, targets["per-prefix reverse"]),
                "err_prefix_reverse": rel_error(kl_grad, targets["per-prefix reverse"]),
                "cos_prefix_forward": cosine(kl_grad, targets["per-prefix forward"]),
                "err_prefix_forward": rel_error(kl_grad, targets["per-prefix forward"]),
                # in units of |grad KL|: the on-policy gradient itself can be exactly zero (k1-loss)
                "err_on_policy": float((kl_grad - kl_grads[on_policy_key]).norm() / targets["unbiased"].norm()),
                "var_grad": variance(grads, weights),
                "var_kl": variance((grads - baseline_groups[sampling, pg_ratio]) / beta, weights),
                "verdict": verdict(kl_grad, targets, tol),
            })
            bar.update()
    bar.close()
    rows = [_aggregate_row(key, results, length) for key, results in per_config.items()]
    setup = {"vocab": vocab, "length": length, "group_size": group_size, "seeds": list(seeds),
             "beta": beta, "advantage": advantage, "tol": tol, "clip_ratio_c": clip_ratio_c}
    return GradientAudit(rows, {k: max(v) for k, v in pg_errors.items()}, setup,
                         {k: sum(v) / len(v) for k, v in pg_variances.items()})


def _aggregate_row(key: tuple[str, str, str, str, str], results: list[dict[str, object]],
                   length: int) -> GradientRow:
    """Mean cosines and variances, worst relative errors, and the verdict if every seed agrees
    ('mixed' if not)."""
    sampling, estimator, placement, ratio, pg_ratio = key
    verdicts = {r["verdict"] for r in results}
    theory = theory_of(sampling, estimator, placement, ratio, pg_ratio, length)
    numbers = {}
    for name in ("norm_ratio", "cos_kl", "cos_prefix_reverse", "cos_prefix_forward", "var_grad", "var_kl"):
        numbers[name] = sum(float(r[name]) for r in results) / len(results)
    for name in ("err_kl", "err_prefix_reverse", "err_prefix_forward", "err_on_policy"):
        numbers[name] = max(float(r[name]) for r in results)
    return GradientRow(sampling, estimator, placement, ratio, pg_ratio,
                       verdict=verdicts.pop() if len(verdicts) == 1 else "mixed", theory=theory, **numbers)


def gradient_table_markdown(audit: GradientAudit) -> str:
    """The gradient audit as a Markdown table, with the policy-gradient check above it."""
    setup = audit.setup
    lines = [
        f"Exact gradient audit: vocabulary {setup['vocab']}, length {setup['length']}, group size "
        f"{setup['group_size']}, advantage {setup['advantage']}, seeds {setup['seeds']}, float64, "
        f"tolerance {setup['tol']:g}"
        + (f", dual clip {setup['clip_ratio_c']:g}." if setup.get("clip_ratio_c") is not None else "."),
        "",
        "Policy-gradient check (no KL): relative error of E[grad loss] against -grad E[R]: "
        + ", ".join(f"{k} {v:.2e}" for k, v in audit.pg_error.items()) + "; the variance of one group's "
        "gradient: " + ", ".join(f"{k} {v:.4f}" for k, v in audit.pg_variance.items()) + ".",
        "",
        "KL part of the expected gradient, g = (E[grad loss] - E[grad loss, no KL]) / beta, against "
        "grad KL(pi||pi_ref) (the sequence reverse KL) and the per-prefix reverse and forward KL "
        "gradients (cos = mean cosine over seeds, err = worst relative error). Off-policy rows also give "
        "the distance to the on-policy KL gradient of the same configuration (the detached weight "
        "compared with no weight), in units of abs grad KL: what the importance weighting leaves "
        "uncorrected. PG ratio: the policy gradient's importance weight, PPO's token ratio or the "
        "sequence ratio pi(y)/mu(y) (with it, each KL-loss token takes its prefix ratio: KL-loss ratio "
        "`sequence`). var = trace of the covariance of the gradient that one sampled group gives (the "
        "noise an update averages over; mean over seeds), of the whole loss and of its KL part g. The reward's "
        "KL is pi's in every row (objective.reward_kl current).",
        "",
        "| sampling | estimator | placement | KL-loss ratio | PG ratio | abs g / abs grad KL | cos KL | err KL "
        "| cos prefix-rev | err prefix-rev | cos prefix-fwd | err prefix-fwd | err vs on-policy | var grad | var g "
        "| verdict | theory |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in audit.rows:
        mark = {True: f"{row.theory} (agrees)", False: f"{row.theory} (DISAGREES)", None: ""}[row.agrees]
        ratio = row.kl_loss_ratio if _in_loss(row.placement) else "-"
        on_policy = f"{row.err_on_policy:.1e}" if row.sampling == "off-policy" else "-"
        lines.append(
            f"| {row.sampling} | {row.estimator} | {row.placement} | {ratio} | {row.pg_ratio} | {row.norm_ratio:.3f} "
            f"| {row.cos_kl:+.3f} | {row.err_kl:.1e} | {row.cos_prefix_reverse:+.3f} | {row.err_prefix_reverse:.1e} "
            f"| {row.cos_prefix_forward:+.3f} | {row.err_prefix_forward:.1e} | {on_policy} | {row.var_grad:.4f} "
            f"| {row.var_kl:.3f} | {row.verdict} | {mark} |"
        )
    return "\n".join(lines)


def gradient_records(audit: GradientAudit) -> list[dict[str, object]]:
    """Plain dicts (for CSV and JSON), one per row, with the agreement column."""
    return [{**asdict(row), "agrees": row.agrees} for row in audit.rows]
