"""Command line of the trainer: `python -m trainer audit ...`."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("trainer")


def _write_records(path: Path, records: list[dict[str, object]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def _audit_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit",
        help="exact gradient audit and convergence audit of every KL configuration",
        description="Checks, on tabular policies, what gradient each estimator x placement of the "
        "objective really computes (exact enumeration) and where training with it converges.",
    )
    p.add_argument("--out", type=Path, help="directory for CSV, JSON, Markdown and the PNG plot")
    p.add_argument("--skip-convergence", action="store_true", help="run only the gradient audit")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show progress bars (default: when stderr is a terminal)")
    g = p.add_argument_group("gradient audit")
    g.add_argument("--vocab", type=int, default=3, help="vocabulary size (default 3)")
    g.add_argument("--length", type=int, default=2, help="response length T (default 2)")
    g.add_argument("--group-size", type=int, default=2, help="samples per group (default 2)")
    g.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="random instances (default 0 1 2)")
    g.add_argument("--beta", type=float, default=0.1, help="KL coefficient (default 0.1)")
    g.add_argument("--advantage", default="rloo", help="rloo|grpo|drgrpo|reinforce (default rloo)")
    g.add_argument("--tol", type=float, default=1e-6, help="relative tolerance of a verdict (default 1e-6)")
    c = p.add_argument_group("convergence audit")
    c.add_argument("--conv-steps", type=int, default=1000, help="training steps (default 1000)")
    c.add_argument("--conv-beta", type=float, default=0.3, help="KL coefficient (default 0.3)")
    c.add_argument("--conv-group-size", type=int, default=4, help="samples per group (default 4)")
    c.add_argument("--conv-groups", type=int, default=32, help="groups per step (default 32)")
    c.add_argument("--conv-lr", type=float, default=0.1, help="Adam learning rate at the start (default 0.1)")
    c.add_argument("--conv-seed", type=int, default=0, help="random instance and sampling seed (default 0)")
    p.set_defaults(func=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    from trainer import audit, convergence

    if args.vocab ** (args.length * args.group_size) > 200_000:
        raise ValueError(
            f"--vocab {args.vocab} --length {args.length} --group-size {args.group_size} means "
            f"{args.vocab ** (args.length * args.group_size):,} groups to enumerate; keep it under 200,000"
        )
    grad = audit.gradient_audit(args.vocab, args.length, args.group_size, tuple(args.seeds), args.beta,
                                args.advantage, args.tol, progress=args.progress)
    print(audit.gradient_table_markdown(grad))
    conv = None
    if not args.skip_convergence:
        conv = convergence.convergence_audit(
            args.vocab, args.length, args.conv_group_size, args.conv_groups, args.conv_steps,
            args.conv_beta, args.conv_lr, seed=args.conv_seed, advantage=args.advantage,
            progress=args.progress)
        print()
        print(convergence.convergence_table_markdown(conv))
    if args.out is not None:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        records = audit.gradient_records(grad)
        _write_records(out / "gradient_audit.csv", records)
        (out / "gradient_audit.json").write_text(
            json.dumps({"setup": grad.setup, "pg_error": grad.pg_error, "rows": records}, indent=2))
        (out / "gradient_audit.md").write_text(audit.gradient_table_markdown(grad) + "\n")
        if conv is not None:
            _write_records(out / "convergence.csv", [
                {"step": step, **{label: curve[i] for label, curve in conv.curves.items()}}
                for i, step in enumerate(conv.steps)])
            (out / "convergence.json").write_text(json.dumps(
                {"setup": conv.setup, "final": conv.final, "steps": conv.steps, "curves": conv.curves}, indent=2))
            (out / "convergence.md").write_text(convergence.convergence_table_markdown(conv) + "\n")
            convergence.plot_convergence(conv, out / "convergence.png")
        log.info("audit written to %s", out)
    disagreements = [r for r in grad.rows if r.agrees is False]
    if disagreements:
        names = "; ".join(f"{r.estimator} {r.placement} ({r.kl_loss_ratio}): {r.verdict}, theory {r.theory}"
                          for r in disagreements)
        log.error("the objective disagrees with KL_THEORY.md: %s", names)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="klstudy's RL trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    _audit_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as error:
        log.error("%s", error)
        return 2


if __name__ == "__main__":
    sys.exit(main())
