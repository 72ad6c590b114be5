"""Moving targets on tabular policies: an adaptive beta and a refreshed reference, trained exactly as the
trainer does (the same `trainer.objective.kl_coefficient` and
`trainer.objective.reference_refresh`), and where they end:
against the optimum of the beta they end with, and against the original reference's optimum.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainer.audits import tabular
from trainer.audits.tabular import one_thread
from trainer.objective import kl
from trainer.objective.kl_coefficient import KLCoefficient
from trainer.objective.loss import ObjectiveConfig, compute_loss
from trainer.objective.reference_refresh import mix_
from trainer.progress import progress_bar

# --- moving targets --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MovingTargetRow:
    label: str
    final_beta: float
    kl_to_optimum_final_beta: float     # KL(pi || pi*(final beta, original reference))
    kl_to_optimum_start_beta: float     # KL(pi || pi*(starting beta, original reference))
    gap_final_beta: float               # J*(final beta) - J(pi), original reference
    kl_to_reference: float              # KL(pi || original pi_ref)
    reward: float


def moving_targets_audit(vocab: int = 3, length: int = 2, group_size: int = 4, groups_per_step: int = 32,
                         steps: int = 600, beta: float = 0.3, lr: float = 0.1, lr_floor: float = 1e-3, seed: int = 0,
                         progress: bool | None = None) -> list[MovingTargetRow]:
    """k1-reward tabular policies trained from pi_ref (as the convergence audit trains them) with beta fixed,
    adaptive (target: half the per-token KL of pi*, horizon 10000, the libraries' controller), and with the
    reference refreshed (a hard copy every tenth of the run; Polyak 0.6 every twentieth)."""
    space = tabular.SequenceSpace(vocab, length)
    gen = torch.Generator().manual_seed(seed)
    ref_logits = space.random_logits(gen)
    rewards = torch.rand(space.n_sequences, generator=gen, dtype=torch.float64)
    ref_seq = space.seq_logp(ref_logits)
    start = tabular.optimum_logp(space, ref_logits, rewards, beta)
    optimum_token_kl = float((start.exp() * (start - ref_seq)).sum()) / length
    base = ObjectiveConfig(estimator="k1", placement="reward", beta=beta, advantage="rloo")
    copy_every, mix_every = max(1, steps // 10), max(1, steps // 20)
    cases = {"fixed beta": base,
             "adaptive beta (target: half pi*'s KL)": replace(base, kl_target=optimum_token_kl / 2, kl_horizon=10000),
             "adaptive beta (target: twice pi*'s KL)": replace(base, kl_target=2 * optimum_token_kl, kl_horizon=10000),
             f"reference copied every {copy_every} steps": replace(base, ref_refresh_every=copy_every),
             f"reference mixed in, alpha 0.6, every {mix_every} steps": replace(base, ref_refresh_every=mix_every,
                                                                                ref_refresh_alpha=0.6)}
    batch = group_size * groups_per_step
    mask = torch.ones(batch, length, dtype=torch.float64)
    rows = []
    bar = progress_bar(len(cases) * steps, "moving targets", progress)
    with one_thread():  # tiny tensors: intra-op threads only contend
        for label, config in cases.items():
            theta = ref_logits.clone().requires_grad_(True)
            reference = ref_logits.clone()
            coefficient = KLCoefficient(config)
            optimizer = torch.optim.Adam([theta], lr=lr)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_floor ** (s / steps))
            sampler = torch.Generator().manual_seed(seed + 1)
            for step in range(steps):
                token_logp = space.token_logp(theta)
                ref_token_logp = space.token_logp(reference)
                with torch.no_grad():
                    picked = torch.multinomial(token_logp.sum(-1).exp(), batch, replacement=True, generator=sampler)
                loss, _ = compute_loss(token_logp[picked], ref_token_logp[picked], None, rewards[picked], mask,
                                       group_size, coefficient.objective(config), stats=False)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                with torch.no_grad():  # as the trainer does after each step
                    estimate = kl.estimate(config.estimator, token_logp[picked], ref_token_logp[picked])
                    coefficient.update(float(estimate.mean()), batch)
                    if config.ref_refresh_every and (step + 1) % config.ref_refresh_every == 0:
                        mix_([reference], [theta], config.ref_refresh_alpha)
                bar.update()
            with torch.no_grad():
                final = coefficient.value
                final_optimum = tabular.optimum_logp(space, ref_logits, rewards, final)
                to_final = float(tabular.sequence_kl(space, theta, final_optimum))
                rows.append(MovingTargetRow(label, final, to_final, float(tabular.sequence_kl(space, theta, start)),
                                            final * to_final, float(tabular.sequence_kl(space, theta, ref_seq)),
                                            float(space.seq_logp(theta).exp() @ rewards)))
    bar.close()
    return rows


def moving_targets_markdown(rows: list[MovingTargetRow], setup: dict[str, object]) -> str:
    lines = [
        f"Moving targets: k1-reward tabular policies (vocabulary {setup['vocab']}, length {setup['length']}, "
        f"{setup['steps']} steps, starting beta {setup['beta']}, seed {setup['seed']}) with an adaptive beta or a "
        "refreshed reference. pi*(beta) is the optimum of E[R] - beta KL(pi || pi_ref) for the ORIGINAL reference; "
        "the gap J*(beta) - J(pi) = beta KL(pi || pi*(beta)) is what `measure` reports (at the final beta).",
        "",
        "| run | final beta | KL(pi ‖ pi*(final beta)) | KL(pi ‖ pi*(starting beta)) | gap at the final beta "
        "| KL(pi ‖ original pi_ref) | E[R] |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.label} | {r.final_beta:.4f} | {max(r.kl_to_optimum_final_beta, 0):.2e} "
                     f"| {max(r.kl_to_optimum_start_beta, 0):.2e} | {max(r.gap_final_beta, 0):.2e} "
                     f"| {r.kl_to_reference:.4f} | {r.reward:.4f} |")
    return "\n".join(lines)
