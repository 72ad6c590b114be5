"""What exact unbiasedness off-policy costs: the KL part of k3-reward+loss's gradient, computed exactly
(trainer.audits.enumeration) on random tabular policies with responses of 1 to 5 tokens, on-policy
and off-policy under three weightings: the token ratios the RL libraries use (the detached weight on
the KL loss, PPO's ratio on the policy gradient), the sequence-level weights (`pg_ratio: sequence`,
`kl_loss_ratio: sequence`), and the same truncated at `sequence_ratio_cap`.

For each it prints the worst relative error against grad KL(pi || pi_ref) over the seeds (the bias)
and the mean variance (trace of the covariance) of one group's sampled KL part (the noise), and
the ratio of that variance to the on-policy one, side by side in one table:

    python benchmarks/sequence_weights.py [--vocab 2] [--lengths 1 2 3 4 5] [--cap 2] [--seeds 0 1 2]

Exact enumeration: vocab ** (length * 2) groups per configuration (1024 at the defaults' longest).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from trainer.audits.enumeration import (
    AuditInstance,
    expectation,
    group_gradients,
    rel_error,
    target_gradients,
    variance,
)
from trainer.objective.loss import ObjectiveConfig

BETA, GROUP = 0.1, 2


def weightings(cap: float) -> dict[str, tuple[ObjectiveConfig, bool]]:
    """name -> (k3-reward+loss config, off-policy)."""
    config = ObjectiveConfig(estimator="k3", placement="reward+loss", beta=BETA, advantage="rloo")
    sequence = replace(config, pg_ratio="sequence", kl_loss_ratio="sequence")
    return {"on-policy": (config, False), "token ratios": (replace(config, kl_loss_ratio="detached"), True),
            "sequence": (sequence, True), f"sequence, cap {cap:g}": (replace(sequence, sequence_ratio_cap=cap), True)}


def kl_part(inst: AuditInstance, config: ObjectiveConfig, off_policy: bool) -> tuple[float, float]:
    """(relative error of the expected KL part against grad KL, variance of one group's KL part)."""
    grads, weights = group_gradients(inst, config, GROUP, off_policy)
    base, _ = group_gradients(inst, replace(config, placement="none"), GROUP, off_policy)
    parts = (grads - base) / BETA
    return rel_error(expectation(parts, weights), target_gradients(inst)["unbiased"]), variance(parts, weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--cap", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    names = list(weightings(args.cap))
    print("| length | " + " | ".join(f"{n}: err, var" for n in names) + " | var against on-policy |")
    print("|---:|" + "---|" * (len(names) + 1))
    for length in args.lengths:
        results = {name: [] for name in names}
        for seed in args.seeds:
            inst = AuditInstance.random(args.vocab, length, seed)
            for name, (config, off_policy) in weightings(args.cap).items():
                results[name].append(kl_part(inst, config, off_policy))
        cells = {name: (max(e for e, _ in r), sum(v for _, v in r) / len(r)) for name, r in results.items()}
        ratios = ", ".join(f"{name} {cells[name][1] / cells['on-policy'][1]:.2f}" for name in names[1:])
        print(f"| {length} | " + " | ".join(f"{e:.1e}, {v:.3f}" for e, v in cells.values()) + f" | {ratios} |")


if __name__ == "__main__":
    main()
