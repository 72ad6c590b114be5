"""`python -m trainer audit`: the exact gradient audits (and, unless skipped, the convergence audits) of every
KL configuration, or of each library's preset, printed as tables and written as CSV, JSON, Markdown and a plot."""

from __future__ import annotations

import argparse
import csv
import json
import logging
from pathlib import Path

from trainer.objective import advantages

log = logging.getLogger("trainer")


def _write_records(path: Path, records: list[dict[str, object]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`python -m trainer audit`: its options."""
    p = sub.add_parser(
        "audit",
        help="exact gradient audit and convergence audit of every KL configuration",
        description="Checks, on tabular policies, what gradient each estimator x placement of the "
        "objective really computes (exact enumeration) and where training with it converges.",
    )
    p.add_argument("--out", type=Path, help="directory for CSV, JSON, Markdown and the PNG plot")
    p.add_argument("--skip-convergence", action="store_true",
                   help="run only the exact audits (no training of tabular policies)")
    p.add_argument("--presets", action="store_true",
                   help="audit only each library's default KL configuration (trainer.objective.presets): what its KL "
                   "gradient is and which objective it follows, on-policy and off-policy; then what whitening the "
                   "advantages does")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show progress bars (default: when stderr is a terminal)")
    g = p.add_argument_group("gradient audit")
    g.add_argument("--vocab", type=int, default=3, help="vocabulary size (default 3)")
    g.add_argument("--length", type=int, default=2, help="response length T (default 2)")
    g.add_argument("--group-size", type=int, default=2, help="samples per group (default 2)")
    g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="random instances (default 0 1 2)")
    g.add_argument("--beta", type=float, default=0.1, help="KL coefficient (default 0.1)")
    g.add_argument("--advantage", default="rloo", help=f"{'|'.join(advantages.REGISTRY.names)} (default rloo)")
    g.add_argument("--tol", type=float, default=1e-6, help="relative tolerance of a verdict (default 1e-6)")
    g.add_argument("--clip-ratio-c", type=float, default=None,
                   help="audit under the dual clip with this bound (objective.clip_ratio_c; default off)")
    c = p.add_argument_group("convergence audit")
    c.add_argument("--conv-steps", type=int, default=1000, help="training steps (default 1000)")
    c.add_argument("--conv-beta", type=float, default=0.3, help="KL coefficient (default 0.3)")
    c.add_argument("--conv-group-size", type=int, default=4, help="samples per group (default 4)")
    c.add_argument("--conv-groups", type=int, default=32, help="groups per step (default 32)")
    c.add_argument("--conv-lr", type=float, default=0.1, help="Adam learning rate at the start (default 0.1)")
    c.add_argument("--conv-seed", type=int, default=0, help="random instance and sampling seed (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The audits the options ask for: their tables printed, and with --out written; 1 where the objective
    disagrees with its theory."""
    from trainer.audits import audit, coefficients, convergence, moving_targets, peers_audit, presets_audit
    from trainer.audits.enumeration import PROMPT_LENGTH

    if args.vocab ** (args.length * args.group_size) > 200_000:
        raise ValueError(
            f"--vocab {args.vocab} --length {args.length} --group-size {args.group_size} means "
            f"{args.vocab ** (args.length * args.group_size):,} groups to enumerate; keep it under 200,000"
        )
    setup = {"vocab": args.vocab, "length": args.length, "prompt_length": PROMPT_LENGTH, "group_size": args.group_size,
             "seeds": list(args.seeds), "beta": args.beta}
    if args.presets:
        rows = presets_audit.presets_audit(args.vocab, args.length, args.group_size, tuple(args.seeds), args.beta,
                                           args.tol, progress=args.progress)
        _write_audit(args.out, "presets_audit", peers_audit.records(rows),
                     presets_audit.presets_markdown(rows, setup), setup)
        whitening = coefficients.whitening_audit(tuple(args.seeds), args.beta, args.tol, progress=args.progress)
        whitening_setup = {**coefficients.WHITENING_SETUP, "seeds": list(args.seeds), "beta": args.beta}
        print()
        _write_audit(args.out, "whitening_audit", peers_audit.records(whitening),
                     coefficients.coefficients_markdown(whitening, whitening_setup), whitening_setup)
        return 0
    grad = audit.gradient_audit(args.vocab, args.length, args.group_size, tuple(args.seeds), args.beta,
                                args.advantage, args.tol, progress=args.progress, clip_ratio_c=args.clip_ratio_c)
    print(audit.gradient_table_markdown(grad))
    additions = peers_audit.additions_audit(args.vocab, args.length, args.group_size, tuple(args.seeds), args.beta,
                                            args.tol, progress=args.progress)
    print()
    print(peers_audit.additions_markdown(additions, setup))
    conv = moving = None
    if not args.skip_convergence:
        conv = convergence.convergence_audit(
            args.vocab, args.length, args.conv_group_size, args.conv_groups, args.conv_steps,
            args.conv_beta, args.conv_lr, seed=args.conv_seed, advantage=args.advantage,
            progress=args.progress)
        print()
        print(convergence.convergence_table_markdown(conv))
        moving = moving_targets.moving_targets_audit(args.vocab, args.length, args.conv_group_size, args.conv_groups,
                                                  args.conv_steps, args.conv_beta, args.conv_lr, seed=args.conv_seed,
                                                  progress=args.progress)
        moving_setup = {**setup, "steps": args.conv_steps, "beta": args.conv_beta, "seed": args.conv_seed}
        print()
        print(moving_targets.moving_targets_markdown(moving, moving_setup))
    if args.out is not None:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        records = audit.gradient_records(grad)
        _write_records(out / "gradient_audit.csv", records)
        (out / "gradient_audit.json").write_text(
            json.dumps({"setup": grad.setup, "pg_error": grad.pg_error, "pg_variance": grad.pg_variance,
                        "rows": records}, indent=2))
        (out / "gradient_audit.md").write_text(audit.gradient_table_markdown(grad) + "\n")
        if conv is not None:
            _write_records(out / "convergence.csv", [
                {"step": step, **{label: curve[i] for label, curve in conv.curves.items()}}
                for i, step in enumerate(conv.steps)])
            (out / "convergence.json").write_text(json.dumps(
                {"setup": conv.setup, "final": conv.final, "steps": conv.steps, "curves": conv.curves}, indent=2))
            (out / "convergence.md").write_text(convergence.convergence_table_markdown(conv) + "\n")
            convergence.plot_convergence(conv, out / "convergence.png")
        _write_audit(out, "peers_audit", peers_audit.records(additions),
                     peers_audit.additions_markdown(additions, setup), setup, print_table=False)
        if moving is not None:
            _write_audit(out, "moving_targets", peers_audit.records(moving),
                         moving_targets.moving_targets_markdown(moving, moving_setup), moving_setup, print_table=False)
        log.info("audit written to %s", out)
    disagreements = [f"{r.estimator} {r.placement} ({r.kl_loss_ratio}): {r.verdict}, theory {r.theory}"
                     for r in grad.rows if r.agrees is False]
    disagreements += [f"{r.label} ({r.sampling}): {r.verdict}, theory {r.theory}"
                      for r in additions if r.agrees is False]
    if disagreements:
        names = "; ".join(disagreements)
        log.error("the objective disagrees with its theory (docs/concepts/theory.md): %s", names)
        return 1
    return 0


def _write_audit(out: Path | None, name: str, records: list[dict[str, object]], markdown: str,
                 setup: dict[str, object], print_table: bool = True) -> None:
    """Print an audit's Markdown table and, with --out, write it as CSV, JSON and Markdown."""
    if print_table:
        print(markdown)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    _write_records(out / f"{name}.csv", records)
    (out / f"{name}.json").write_text(json.dumps({"setup": setup, "rows": records}, indent=2))
    (out / f"{name}.md").write_text(markdown + "\n")
    log.info("%s written to %s", name, out)
