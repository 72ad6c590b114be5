"""Command line of the evaluation: `python -m eval run ...` (its options: eval.cli)."""

from __future__ import annotations

import gc
import json
import logging
import sys

log = logging.getLogger("eval")


def main(argv: list[str] | None = None) -> int:
    from eval.cli import parser, requests

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from eval.harness import METRICS_FILE, evaluate

    try:
        asked = requests(args)
    except ValueError as error:  # options that do not pair up, or bad --data: one line
        log.error("%s", error)
        return 2
    failed = []
    for request in asked:
        out, model = request.out, request.settings.model
        if (out / METRICS_FILE).is_file():  # a finished evaluation is never rewritten (a requeued job's)
            log.info("%s already holds a finished evaluation (%s): nothing to do; delete it to evaluate again",
                     out, METRICS_FILE)
            print(json.dumps({"out": str(out)}))
            continue
        try:
            metrics = evaluate(request.settings, out, request.model_record)
        except Exception as error:  # noqa: BLE001 - one model's failure stops no other evaluation of the job
            if isinstance(error, ValueError):  # bad options, model or data: one line, no traceback
                log.error("%s: %s", model, error)
            else:
                log.exception("%s: the evaluation failed", model)
            failed.append(str(out))
            continue
        for task, row in metrics["tasks"].items():
            extra = f"  pass@{row['pass@k']['k']} {row['pass@k']['value']:.3f}" if "pass@k" in row else ""
            stderr = f" ± {row['stderr']:.3f}" if row["stderr"] is not None else ""
            print(f"{task:24s} pass@1 {row['value']:.3f}{stderr}  (n={row['n']}){extra}")
        print(json.dumps({"out": str(out)}))
    if failed:
        log.error("%d of %d evaluations failed: %s", len(failed), len(asked), ", ".join(failed))
        return 2
    return 0


if __name__ == "__main__":
    status = main()
    gc.freeze()  # the interpreter's last collections skip lm-eval's, torch's and the models' objects: about 1 s of CPU
    sys.exit(status)
