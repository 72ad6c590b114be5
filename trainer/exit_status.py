"""How a trainer process ends, apart from the run (no torch), so that the command line and SLURM's task
wrapper can use it before or without loading a run."""

from __future__ import annotations

import gc
import signal
import sys
import traceback
from typing import Callable

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on SIGTERM; run the same command again to resume
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C, as a shell reports it
# How long a trainer that failed or was stopped may take to shut down: a shutdown that hangs (a thread
# that never joins) ends by SIGALRM rather than holding its job until the launcher's SIGKILL (an hour
# under accelerate launch, trainer.launch.SHUTDOWN_GRACE_S), or for ever under Snakemake.
SHUTDOWN_LIMIT_S = 60


def exit_with(status: int, limit_s: int = SHUTDOWN_LIMIT_S) -> None:
    """Ends the process with `status`; any status but 0 within `limit_s` seconds. A trainer that
    checkpointed on SIGTERM (EXIT_PREEMPTED) ignores SIGTERM from here on: when one task of a SLURM step
    exits 75 first, srun (--kill-on-bad-exit) terminates the others, and one still shutting down after its
    checkpoint would otherwise die by the signal (143) and the job end FAILED rather than preempted.
    Ignored, not handled: the interpreter drops Python handlers as it shuts down. What the process made is
    frozen (gc.freeze), so that the interpreter's last collections, as it exits, skip it: walking the
    objects of torch, transformers and the run took about 1 s of CPU at the end of every trainer process."""
    if status == EXIT_PREEMPTED:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if status:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the alarm ends the process, whoever handled it before
        signal.alarm(limit_s)
    gc.freeze()
    sys.exit(status)


def run_and_exit(main: Callable[[], int], limit_s: int = SHUTDOWN_LIMIT_S) -> None:
    """Runs a command's `main` and ends the process through exit_with, an exception too: Ctrl-C as 130
    with one line, any other error with its traceback as 1. A Ctrl-C that landed while transformers
    started its first model-loading thread left that thread waiting for work that never came, and the
    interpreter waited for the thread for ever: Snakemake's Ctrl-C never returned (CI)."""
    try:
        status = main()
    except KeyboardInterrupt:
        print("interrupted (SIGINT)", file=sys.stderr)
        status = EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - reported as Python would, then ended within the limit
        traceback.print_exc()
        status = 1
    exit_with(status, limit_s)
