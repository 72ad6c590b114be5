"""How a trainer process ends, apart from the run (no torch), so that the command line and SLURM's task
wrapper can use it before or without loading a run."""

from __future__ import annotations

import signal
import sys

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed on SIGTERM; run the same command again to resume
# How long a preempted trainer may take to shut down once SIGTERM no longer stops it: a shutdown that
# hangs (a thread that never joins) ends by SIGALRM rather than holding its job until the launcher's
# SIGKILL (an hour under accelerate launch, trainer.launch.SHUTDOWN_GRACE_S).
SHUTDOWN_LIMIT_S = 60


def exit_with(status: int, limit_s: int = SHUTDOWN_LIMIT_S) -> None:
    """Ends the process with `status`. A trainer that checkpointed on SIGTERM (EXIT_PREEMPTED) ignores SIGTERM
    from here on: when one task of a SLURM step exits 75 first, srun (--kill-on-bad-exit) terminates the
    others, and one still shutting down after its checkpoint would otherwise die by the signal (143) and the
    job end FAILED rather than preempted. Ignored, not handled: the interpreter drops Python handlers as it
    shuts down."""
    if status == EXIT_PREEMPTED:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.alarm(limit_s)
    sys.exit(status)
