"""Exact audit of each library's default KL configuration (trainer.objective.presets): the papers' Table 1, executable.

For each preset at the audit's beta, on `trainer.audits.enumeration`'s random tabular instances and through
`compute_loss` itself, on-policy and off-policy (samples of mu, the libraries' token ratios, or the preset's own
ratio; the reward's KL from the sampler unless the preset says otherwise):

- the KL part of the expected gradient, (E[grad loss] - E[grad loss, no KL]) / beta, and its verdict (grad KL, the
  per-prefix KLs, scaled, zero, biased);
- the whole expected gradient split into the reward's and the KL's directions (`trainer.audits.coefficients`):
  which objective E[R] - beta_eff KL it follows, if any. This is what says what a preset's own advantage does
  (whitening, a group-mean baseline on R or on the KL).

A preset that sets its advantage is audited with it; the others with RLOO.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from trainer.audits import tabular
from trainer.audits.audit import verdict
from trainer.audits.coefficients import decompose, objective_verdict
from trainer.audits.enumeration import (
    AuditInstance,
    expectation,
    group_gradients,
    rel_error,
    target_gradients,
    variance,
)
from trainer.objective import presets
from trainer.objective.objective_config import ObjectiveConfig
from trainer.progress import progress_bar

WORDS = {"unbiased": "grad KL(pi || pi_ref)", "per-prefix reverse": "sum_t E[grad KL_t(pi || pi_ref)] (per-prefix "
         "reverse)", "per-prefix forward": "sum_t E[grad KL_t(pi_ref || pi)] (per-prefix forward)",
         "zero": "0: no regularization", "biased": "none of these (biased)", "scaled": "c grad KL, c != 1 (scaled)",
         "scaled per-prefix forward": "c sum_t E[grad KL_t(pi_ref || pi)], c != 1 (scaled per-prefix forward)",
         "scaled per-prefix reverse": "c sum_t E[grad KL_t(pi || pi_ref)], c != 1 (scaled per-prefix reverse)"}


@dataclass(frozen=True)
class PresetRow:
    preset: str
    library: str
    library_beta: float
    advantage: str
    estimator: str
    placement: str
    kl_loss_ratio: str
    clamps: str
    engine_weights: str
    pg_ratio: str
    on_policy: str
    err_on_policy: float
    off_policy: str
    err_off_policy: float
    objective_on: str     # exact | rescaled | biased | no KL: the whole gradient, on-policy
    beta_ratio_on: float  # beta_eff / beta, median over seeds
    bias_on: float        # worst over seeds
    objective_off: str
    beta_ratio_off: float
    bias_off: float
    var_kl: float
    source: str

    @property
    def unbiased(self) -> tuple[bool, bool]:
        return self.on_policy == "unbiased", self.off_policy == "unbiased"


def audited(preset: presets.Preset, beta: float) -> ObjectiveConfig:
    """The preset at the audit's beta, with RLOO unless it sets its own advantage."""
    return ObjectiveConfig.of_preset(preset.name, beta=beta,
                                     **({} if "advantage" in preset.keys else {"advantage": "rloo"}))


def _agreed(values: list[str]) -> str:
    return values[0] if len(set(values)) == 1 else "mixed"


def presets_audit(vocab: int = 3, length: int = 2, group_size: int = 2, seeds: tuple[int, ...] = (0, 1, 2),
                  beta: float = 0.1, tol: float = 1e-6, progress: bool | None = None) -> list[PresetRow]:
    """Each preset on every seed, on-policy and off-policy."""
    groups = tabular.SequenceSpace(vocab, length).groups(group_size)
    keys = ("on", "off", "err_on", "err_off", "var", "obj_on", "obj_off", "ratio_on", "ratio_off", "bias_on",
            "bias_off")
    found: dict[str, dict[str, list]] = {p.name: {k: [] for k in keys} for p in presets.REGISTRY}
    bar = progress_bar(len(seeds) * len(presets.REGISTRY), "presets audit", progress)
    for seed in seeds:
        inst = AuditInstance.random(vocab, length, seed)
        targets = target_gradients(inst)
        for preset in presets.REGISTRY:
            config, record = audited(preset, beta), found[preset.name]
            for key, off_policy in (("on", False), ("off", True)):
                grads, weights = group_gradients(inst, config, group_size, off_policy, groups)
                coefficients = decompose(expectation(grads, weights), targets)
                record[f"ratio_{key}"].append(coefficients.beta_eff / beta)
                record[f"bias_{key}"].append(coefficients.bias)
                record[f"obj_{key}"].append("no KL" if config.placement == "none"
                                            else objective_verdict(coefficients, beta, tol))
                if config.placement == "none":
                    record[key].append("zero"), record[f"err_{key}"].append(1.0)
                    record["var"].append(0.0) if key == "on" else None
                    continue
                base_grads, _ = group_gradients(inst, replace(config, placement="none"), group_size, off_policy,
                                                groups)
                part = (grads - base_grads) / beta
                mean = expectation(part, weights)
                record[key].append(verdict(mean, targets, tol))
                record[f"err_{key}"].append(rel_error(mean, targets["unbiased"]))
                if key == "on":
                    record["var"].append(variance(part, weights))
            bar.update()
    bar.close()
    return [_row(preset, found[preset.name]) for preset in presets.REGISTRY]


def _row(preset: presets.Preset, record: dict[str, list]) -> PresetRow:
    config = ObjectiveConfig.of_preset(preset.name)
    clamps = ", ".join(f"{name} {value:g}" for name, value in (("log-ratio", config.kl_log_ratio_clamp),
                                                                ("value", config.kl_value_clamp)) if value)
    tis = "-" if config.tis_cap is None else (f"{config.tis_level} {config.tis_mode} "
                                               f"[{config.tis_floor or 0:.3g}, {config.tis_cap:g}]")
    ratio = config.pg_ratio
    if config.pg_ratio == "sequence" and config.clip_eps is not None:
        ratio += f", clipped {config.clip_eps:g}"
    if config.ratio_cap is not None:
        ratio += f" {config.ratio_mode} [{config.ratio_floor or 0:g}, {config.ratio_cap:g}]"
    kl_ratio = config.kl_loss_ratio if config.any_kl_in_loss else "-"
    placement = config.placement + {"reference": "", "behaviour": " (to mu)", "both": " (+ loss to mu)"}[config.kl_to]
    if config.kl_in_loss and config.kl_loss_agg is not None:
        kl_ratio += f" ({config.kl_loss_agg})"
    return PresetRow(preset.name, preset.library, config.beta, audited(preset, 0.1).advantage,
                     config.estimator if config.placement != "none" else "-", placement, kl_ratio,
                     clamps or "-", tis, ratio, _agreed(record["on"]), max(record["err_on"]), _agreed(record["off"]),
                     max(record["err_off"]), _agreed(record["obj_on"]), statistics.median(record["ratio_on"]),
                     max(record["bias_on"]), _agreed(record["obj_off"]), statistics.median(record["ratio_off"]),
                     max(record["bias_off"]), sum(record["var"]) / len(record["var"]), preset.source.cite)


def presets_markdown(rows: list[PresetRow], setup: dict[str, object]) -> str:
    lines = [
        f"Each library's default KL configuration (trainer.objective.presets), audited exactly: "
        f"vocabulary {setup['vocab']}, length {setup['length']} (after a prompt of {setup['prompt_length']} tokens, "
        f"which only the paper-* presets' aggregation reads), group size {setup['group_size']}, seeds "
        f"{setup['seeds']}, every preset at beta {setup['beta']} (the library's own default in its column), with its "
        "own advantage where it sets one, else RLOO. The KL part of the expected gradient, (E[grad loss] - E[grad "
        "loss, no KL]) / beta, on-policy and off-policy (samples of mu, the preset's ratios, the reward's KL as the "
        "preset computes it); err: worst relative error against grad KL(pi || pi_ref); var: of the KL part of one "
        "group's gradient, on-policy. Objective: the whole expected gradient as a (-grad E[R]) + b grad KL + r "
        "(trainer.audits.coefficients): exact = E[R] - beta KL, rescaled = E[R] - beta_eff KL with beta_eff / beta "
        "as given (the median over seeds), no regularization = E[R] alone, biased = neither (bias |r| / |g|, the "
        "worst seed). On these instances "
        "no KL clamp binds (|l| < 3); tests/test_presets_fidelity.py checks each preset against its library where "
        "they all do.",
        "",
        "| preset | library | its beta | advantage | estimator | placement | KL-loss weight | clamps | engine weights "
        "| PG ratio | the KL gradient, on-policy | off-policy | err on / off | objective, on-policy | beta_eff / "
        "beta, bias | objective, off-policy | beta_eff / beta, bias | var | read from |",
        "|---|---|---:|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r.preset} | {r.library} | {r.library_beta:g} | {r.advantage} | {r.estimator} | {r.placement} "
                     f"| {r.kl_loss_ratio} | {r.clamps} | {r.engine_weights} | {r.pg_ratio} "
                     f"| {WORDS.get(r.on_policy, r.on_policy)} | {r.off_policy} "
                     f"| {r.err_on_policy:.1e} / {r.err_off_policy:.1e} | {r.objective_on} "
                     f"| {r.beta_ratio_on:.3f}, {r.bias_on:.1e} | {r.objective_off} "
                     f"| {r.beta_ratio_off:.3f}, {r.bias_off:.1e} | {r.var_kl:.3f} | {r.source} |")
    return "\n".join(lines)
