"""Exact audit of the RL libraries' KL machinery: the settings that reproduce them, and their presets.

Two parts here, all on `trainer.audits.enumeration`'s random tabular instances and through `compute_loss` itself:

- `additions_audit`: what each setting added to reproduce the peers differentiates (clamps, the
  KL-loss weights `engine` and `score`, the entropy bonus, the engine weights of the policy
  gradient), exactly, with the variance of one group's gradient; each case states the verdict
  docs/peers.md derives, and the audit says whether it agrees. Every registered aggregation gets a row, and
  so does every registered ratio that the gradient audit leaves out (a plugin's).
- `trainer.audits.presets_audit`: for each library's default (trainer.objective.presets), what its KL gradient
  is on-policy and off-policy (token ratios, as the libraries weight), and whether it is unbiased: the papers'
  Table 1, executable.
- `trainer.audits.moving_targets`: tabular policies trained with an adaptive beta or a refreshed reference.

The per-token KL rewards (reward-to-go, reward-token) and k3+ are registrations: the main gradient
audit has their rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

from trainer.audits import tabular
from trainer.audits.audit import audit_configs, verdict
from trainer.audits.enumeration import (
    AuditInstance,
    cosine,
    expectation,
    group_gradients,
    rel_error,
    target_gradients,
    variance,
)
from trainer.objective import kl, kl_loss_ratios, loss_aggs, pg_ratios
from trainer.objective.loss import ObjectiveConfig
from trainer.progress import progress_bar

SAMPLINGS = {"on-policy": (False, False), "off-policy": (True, False), "engine mismatch": (False, True)}
NORM_LENGTH = 5  # seq-mean-token-sum-norm's constant in the aggregation rows


@dataclass(frozen=True)
class Case:
    """One audited setting: its config and the config without it (their difference is its part of the
    gradient), the sampling, what the part is divided by, and the verdict docs/peers.md states."""

    section: str
    label: str
    config: ObjectiveConfig
    base: ObjectiveConfig
    sampling: str
    theory: str
    scale: str = "beta"  # beta | entropy | 1 (the policy gradient itself, against -grad E[R])


@dataclass(frozen=True)
class PartRow:
    section: str
    label: str
    sampling: str
    norm_ratio: float   # abs part / abs of its reference gradient (grad KL; grad H for the entropy; grad E[R])
    cos: float
    err: float          # worst relative error against the theory's target (or grad KL where it names none)
    err_on_policy: float
    clamped: float      # share of tokens a clamp binds on (under the sampler), mean over seeds
    var_part: float
    var_grad: float
    verdict: str
    theory: str

    @property
    def agrees(self) -> bool | None:
        return None if not self.theory else self.theory in self.verdict.split(" = ")


def _base(**kwargs) -> ObjectiveConfig:
    return ObjectiveConfig(placement="none", advantage="rloo", reward_kl="current", **kwargs)


def addition_cases(beta: float = 0.1, length: int = 2) -> list[Case]:
    """The settings added to reproduce the peers, each where its theory says something (docs/peers.md); and
    a row for every registered aggregation, and for every registered ratio the gradient audit leaves out."""
    none = _base(beta=beta)
    k3_loss = replace(none, estimator="k3", placement="loss")
    k1_to_go = replace(none, estimator="k1", placement="reward-to-go")
    cases = [
        Case("clamps", "k3 loss, clamps 20 / 10 (verl, SkyRL, NeMo-RL)",
             replace(k3_loss, kl_log_ratio_clamp=20.0, kl_value_clamp=10.0), none, "on-policy", "per-prefix forward"),
        Case("clamps", "k3 loss, log-ratio clamped at 0.3", replace(k3_loss, kl_log_ratio_clamp=0.3), none,
             "on-policy", "biased"),
        Case("clamps", "k1 reward-to-go, value clamp 10 (OpenRLHF)", replace(k1_to_go, kl_value_clamp=10.0), none,
             "on-policy", "unbiased"),
        Case("clamps", "k1 reward-to-go, value clamped at 0.3", replace(k1_to_go, kl_value_clamp=0.3), none,
             "on-policy", "biased"),
        Case("clamps", "k3 reward+loss, log-ratio clamped at 0.3",
             replace(k3_loss, placement="reward+loss", kl_log_ratio_clamp=0.3), none, "on-policy", "biased"),
    ]
    for ratio in ("engine", "score", "differentiable"):
        weighted = replace(k3_loss, kl_loss_ratio=ratio)
        cases += [Case("KL-loss weight", f"k3 loss, {ratio}", weighted, none, sampling, theory)
                  for sampling, theory in (("on-policy", "per-prefix reverse"), ("off-policy", ""),
                                           ("engine mismatch", ""))]
    cases += [Case("KL-loss weight", "k3 loss, none", k3_loss, none, "engine mismatch", "")]
    bonus = replace(none, entropy_coef=0.1)
    cases += [Case("entropy bonus", "entropy_coef 0.1", bonus, none, sampling, theory, scale="entropy")
              for sampling, theory in (("on-policy", "per-prefix entropy"), ("off-policy", ""))]
    engine = [("none", {}), ("token TIS, cap 2 (verl, slime)", {"tis_cap": 2.0}),
              ("token TIS, [0.5, 5] (OpenRLHF)", {"tis_cap": 5.0, "tis_floor": 0.5}),
              ("token TIS, [0.5, 2]", {"tis_cap": 2.0, "tis_floor": 0.5}),
              ("IcePop, [0.5, 2]", {"tis_cap": 2.0, "tis_floor": 0.5, "tis_mode": "mask"}),
              ("sequence TIS, cap 5 (SkyRL)", {"tis_cap": 5.0, "tis_level": "sequence"}),
              ("sequence weight, untruncated", {"tis_cap": 1e9, "tis_level": "sequence"}),
              ("sequence mask, cap 3 (TRL)", {"tis_cap": 3.0, "tis_level": "sequence", "tis_mode": "mask"}),
              ("seq-mask-tis, [0.5, 2] (OpenRLHF, NeMo-RL)",
               {"tis_cap": 2.0, "tis_floor": 0.5, "tis_level": "geometric", "tis_mode": "mask"})]
    cases += [Case("engine weights", label, replace(none, **values), none, "engine mismatch",
                   "exact" if label == "sequence weight, untruncated" else "", scale="1") for label, values in engine]
    ratios = [("token ratio", {}, ""),
              ("token ratio clamped to [0, 8] (the Comedy paper's fork)", {"ratio_cap": 8.0}, ""),
              ("token ratio masked outside [0.125, 8] (the fork's IcePop)",
               {"ratio_cap": 8.0, "ratio_floor": 0.125, "ratio_mode": "mask"}, ""),
              ("sequence ratio", {"pg_ratio": "sequence"}, "exact"),
              ("sequence ratio, PPO-clipped at 0.2 (TRL RLOO)", {"pg_ratio": "sequence", "clip_eps": 0.2}, ""),
              ("DPPO's trust region, 0.2 (prime-rl)", {"pg_ratio": "dppo-tv", "clip_eps": 0.2}, ""),
              ("DPPO's trust region, weight truncated at 3 (verl dppo_tv)",
               {"pg_ratio": "dppo-tv", "clip_eps": 0.2, "ratio_cap": 3.0}, ""),
              ("DPPO's binary-KL region, 0.2 (verl dppo_kl)", {"pg_ratio": "dppo-kl", "clip_eps": 0.2}, "")]
    cases += [Case("policy-gradient ratio", label, replace(none, **values), none, "off-policy", theory, scale="1")
              for label, values, theory in ratios]
    cases += aggregation_cases(none, k3_loss, length)
    cases += behaviour_cases(none)
    return cases + unaudited_cases(cases, none, k3_loss)


# What a KL to mu (objective.kl_to behaviour, placement loss) differentiates, by estimator and KL-loss weight,
# from samples of mu (docs/concepts/theory.md, "A KL to the behaviour policy"); exactly on-policy, zero for all.
BEHAVIOUR_THEORY = {
    ("k1", "none"): "-KL(mu||pi)", ("k1", "detached"): "zero", ("k1", "sequence"): "zero",
    ("k1", "differentiable"): "prefix KL(pi||mu), mu's prefixes",
    ("k2", "none"): "E_mu[k2]", ("k2", "detached"): "prefix KL(pi||mu), mu's prefixes",
    ("k2", "sequence"): "prefix KL(pi||mu)",
    ("k3", "detached"): "KL(mu||pi)", ("k3", "differentiable"): "prefix KL(pi||mu), mu's prefixes",
    ("k3", "sequence"): "prefix KL(mu||pi)", ("k3", "score"): "E_mu[k2]",
}
BEHAVIOUR_TARGETS = ("KL(pi||mu)", "KL(mu||pi)", "-KL(mu||pi)", "prefix KL(pi||mu), mu's prefixes",
                     "prefix KL(pi||mu)", "prefix KL(mu||pi)", "E_mu[k2]")


def behaviour_cases(none: ObjectiveConfig) -> list[Case]:
    """A KL to mu in the loss, for each sampled estimator and KL-loss weight that needs no engine of its own:
    exactly on-policy its part vanishes in expectation; from samples of mu, what it pulls toward."""
    cases = []
    for estimator in ("k1", "k2", "k3"):
        for ratio in ("none", "detached", "differentiable", "sequence", "score"):
            config = replace(none, estimator=estimator, placement="loss", kl_to="behaviour", kl_loss_ratio=ratio)
            cases += [Case("KL to mu", f"{estimator} loss to mu, {ratio}", config, none, sampling, theory,
                           scale="behaviour")
                      for sampling, theory in (("on-policy", "zero"),
                                               ("off-policy", BEHAVIOUR_THEORY.get((estimator, ratio), "")))]
    return cases


def aggregation_cases(none: ObjectiveConfig, k3_loss: ObjectiveConfig, length: int) -> list[Case]:
    """A row for each registered aggregation: the k3 loss's part, on-policy. With responses of one length, an
    aggregation other than the token sums' (docs/concepts/theory.md, "When the identities are exact")
    scales it by a constant (1 / length, 1 / norm_length, or 1 / (the prompt's length + length) with the
    enumeration's PROMPT_LENGTH); at length 1 the audit states nothing."""
    cases = []
    for agg in loss_aggs.REGISTRY:
        values = {"loss_agg": agg.name, "norm_length": NORM_LENGTH if agg.needs_norm_length else None}
        theory = "per-prefix forward" if agg.sums_tokens else "scaled per-prefix forward" if length > 1 else ""
        cases.append(Case("aggregation", f"k3 loss, {agg.name}", replace(k3_loss, **values), replace(none, **values),
                          "on-policy", theory))
    return cases


def unaudited_cases(cases: list[Case], none: ObjectiveConfig, k3_loss: ObjectiveConfig) -> list[Case]:
    """A row for each registered KL-loss ratio and policy-gradient ratio that neither the gradient audit nor a
    case above audits (a plugin's), with no stated theory: what it differentiates is in the audit all the same."""
    configs = audit_configs()
    seen_kl = {c[3] for c in configs} | {case.config.kl_loss_ratio for case in cases if case.config.kl_in_loss}
    seen_pg = {c[4] for c in configs} | {case.config.pg_ratio for case in cases}
    extra = [Case("KL-loss weight", f"k3 loss, {name}", replace(k3_loss, kl_loss_ratio=name), none, sampling, "")
             for name in kl_loss_ratios.REGISTRY.names if name not in seen_kl
             for sampling in ("on-policy", "off-policy")]
    extra += [Case("policy-gradient ratio", f"{name} ratio", replace(none, pg_ratio=name), none, "off-policy", "",
                   scale="1") for name in pg_ratios.REGISTRY.names if name not in seen_pg]
    return extra


def _targets(inst: AuditInstance) -> dict[str, Tensor]:
    """grad KL and the per-prefix KLs, -grad of the per-prefix and the sequence entropy (an entropy
    bonus's part of the gradient of the loss), and -grad E[R] (the policy gradient's)."""
    targets = target_gradients(inst)
    space = inst.space

    def grad_of(fn) -> Tensor:
        theta = inst.logits.clone().requires_grad_(True)
        return torch.autograd.grad(fn(theta), theta)[0]

    targets["per-prefix entropy"] = -grad_of(lambda th: tabular.prefix_entropy(space, th))
    targets["sequence entropy"] = -grad_of(lambda th: tabular.sequence_entropy(space, th))
    targets["exact"] = -targets["reward"]
    mu = inst.behaviour_logits
    mu_seq = space.seq_logp(mu)
    targets["KL(pi||mu)"] = grad_of(lambda th: tabular.sequence_kl(space, th, mu_seq))
    targets["KL(mu||pi)"] = grad_of(lambda th: (mu_seq.exp() * (mu_seq - space.seq_logp(th))).sum())
    targets["-KL(mu||pi)"] = -targets["KL(mu||pi)"]
    targets["prefix KL(pi||mu), mu's prefixes"] = grad_of(lambda th: tabular.prefix_kl(space, th, mu, "reverse", mu))
    targets["prefix KL(pi||mu)"] = grad_of(lambda th: tabular.prefix_kl(space, th, mu, "reverse"))
    targets["prefix KL(mu||pi)"] = grad_of(lambda th: tabular.prefix_kl(space, th, mu, "forward"))
    targets["E_mu[k2]"] = grad_of(lambda th: tabular.prefix_squared_log_ratio(space, th, mu))
    return targets


def _clamped_share(inst: AuditInstance, config: ObjectiveConfig, sampling: str) -> float:
    """The share of response tokens whose estimate a clamp binds on, in expectation under the sampler."""
    if config.kl_log_ratio_clamp is None and config.kl_value_clamp is None:
        return 0.0
    space = inst.space
    logp, ref = space.token_logp(inst.logits), space.token_logp(inst.ref_logits)
    sampler = space.seq_logp(inst.behaviour_logits if sampling != "on-policy" else inst.logits).exp()
    cut = kl.clamped(config.estimator, logp, ref, config.kl_log_ratio_clamp, config.kl_value_clamp)
    return float(sampler @ cut.double().mean(-1))


def _part(inst: AuditInstance, case: Case, group_size: int, groups: Tensor) -> tuple[Tensor, float, float]:
    """The case's part of the expected gradient, its variance over one group, and the whole gradient's."""
    off_policy, engine = SAMPLINGS[case.sampling]
    grads, weights = group_gradients(inst, case.config, group_size, off_policy, groups, engine)
    if case.scale == "1":
        return expectation(grads, weights), variance(grads, weights), variance(grads, weights)
    base, _ = group_gradients(inst, case.base, group_size, off_policy, groups, engine)
    scale = case.config.entropy_coef if case.scale == "entropy" else case.config.beta  # kl_to behaviour: its beta
    part = (grads - base) / scale
    return expectation(part, weights), variance(part, weights), variance(grads, weights)


def _verdict(part: Tensor, targets: dict[str, Tensor], case: Case, tol: float) -> str:
    if case.scale == "entropy":
        names = [n for n in ("per-prefix entropy", "sequence entropy") if rel_error(part, targets[n]) <= tol]
        return " = ".join(names) if names else "biased"
    if case.scale == "1":
        return "exact" if rel_error(part, targets["exact"]) <= tol else "biased"
    if case.scale == "behaviour":  # toward mu: zero in units of the reference KL's gradient, else mu's targets
        if float(part.norm()) <= tol * float(targets["unbiased"].norm()):
            return "zero"
        names = [n for n in BEHAVIOUR_TARGETS if rel_error(part, targets[n]) <= tol]
        return " = ".join(names) if names else "other"
    return verdict(part, targets, tol)


def additions_audit(vocab: int = 3, length: int = 2, group_size: int = 2, seeds: tuple[int, ...] = (0, 1, 2),
                    beta: float = 0.1, tol: float = 1e-6, progress: bool | None = None) -> list[PartRow]:
    """Every addition case on every seed, aggregated as the gradient audit's rows are."""
    cases = addition_cases(beta, length)
    groups = tabular.SequenceSpace(vocab, length).groups(group_size)
    results: dict[int, list[dict[str, object]]] = {i: [] for i in range(len(cases))}
    bar = progress_bar(len(seeds) * len(cases), "peers audit", progress)
    for seed in seeds:
        inst = AuditInstance.random(vocab, length, seed)
        targets = _targets(inst)
        on_policy: dict[str, Tensor] = {}
        for i, case in enumerate(cases):
            part, var_part, var_grad = _part(inst, case, group_size, groups)
            reference = {"entropy": targets["per-prefix entropy"], "1": targets["exact"]}.get(case.scale,
                                                                                              targets["unbiased"])
            target = targets.get(case.theory, reference) if case.theory not in ("", "biased", "zero") else reference
            if case.sampling == "on-policy":
                on_policy[case.label] = part
            results[i].append({"norm_ratio": float(part.norm() / reference.norm()), "cos": cosine(part, target),
                               "err": rel_error(part, target), "var_part": var_part, "var_grad": var_grad,
                               "err_on_policy": float((part - on_policy[case.label]).norm() / reference.norm())
                               if case.label in on_policy else float("nan"),
                               "clamped": _clamped_share(inst, case.config, case.sampling),
                               "verdict": _verdict(part, targets, case, tol)})
            bar.update()
    bar.close()
    return [_row(case, results[i]) for i, case in enumerate(cases)]


def _row(case: Case, results: list[dict[str, object]]) -> PartRow:
    verdicts = {r["verdict"] for r in results}
    mean = {k: sum(float(r[k]) for r in results) / len(results) for k in ("norm_ratio", "cos", "var_part", "var_grad",
                                                                          "clamped")}
    worst = {k: max(float(r[k]) for r in results) for k in ("err", "err_on_policy")}
    return PartRow(case.section, case.label, case.sampling, verdict=verdicts.pop() if len(verdicts) == 1 else "mixed",
                   theory=case.theory, **mean, **worst)


def additions_markdown(rows: list[PartRow], setup: dict[str, object]) -> str:
    lines = [
        f"The peers' settings, exactly: vocabulary {setup['vocab']}, length {setup['length']} (after a prompt of "
        f"{setup['prompt_length']} tokens, which only seq-mean-token-sum-seq-len reads), group size "
        f"{setup['group_size']}, RLOO, beta {setup['beta']}, seeds {setup['seeds']}. part = the setting's part of "
        "the expected gradient: (E[grad loss] - E[grad loss without it]) / beta (/ entropy_coef for the entropy "
        "bonus; the whole policy gradient for the engine weights). Its target: grad KL unless the theory names "
        "another (the per-prefix KLs, -grad of the per-prefix entropy, -grad E[R] for the engine weights). "
        "`engine mismatch`: the groups come from mu, which the trainer takes for itself (old_logp None) and "
        "gets as the engine's log-probs. err vs on-policy: in units of the target's norm. clamped: the share "
        "of tokens a clamp binds on. var = trace of the covariance of one group's gradient (of the part; of "
        "the whole loss).",
        "",
        "| setting | case | sampling | abs part / abs target | cos | err | err vs on-policy | clamped | var part "
        "| var grad | verdict | docs/peers.md |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        mark = {True: f"{r.theory} (agrees)", False: f"{r.theory} (DISAGREES)", None: ""}[r.agrees]
        on_policy = "-" if r.sampling == "on-policy" or r.err_on_policy != r.err_on_policy else f"{r.err_on_policy:.1e}"
        lines.append(f"| {r.section} | {r.label} | {r.sampling} | {r.norm_ratio:.3f} | {r.cos:+.3f} | {r.err:.1e} "
                     f"| {on_policy} | {r.clamped:.2f} | {r.var_part:.3f} | {r.var_grad:.4f} | {r.verdict} | {mark} |")
    return "\n".join(lines)


def records(rows: list) -> list[dict[str, object]]:
    """Plain dicts (for CSV and JSON), one per row."""
    return [{**asdict(row), **({"agrees": row.agrees} if hasattr(row, "agrees") else {})} for row in rows]
