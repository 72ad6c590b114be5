"""How a SLURM task starts submitit's job runner: with SLURM's time-limit warning held back until
submitit can take it.

SLURM sends its warning (USR2, `signal_delay` before the limit) at one of its checks, every 30 s and up
to 60 s early. With a limit short enough that check can fall in the task's first second, while submitit
still imports itself and unpickles the job; its USR2 handler is not installed yet, and USR2's default
action kills the task: the job fails where it should have been requeued. This file blocks USR2 first
thing (it runs by path, so no package is imported before it). A warning then stays pending until
`JobCommand` unblocks it, once submitit's handler is in place, and it is taken like any other warning:
checkpoint, requeue.

submitit puts its `python` setting before `-u -m submitit.core._submit FOLDER`; `submitit_python()` is
that setting, and this file, given those arguments, runs what they name.
"""

import signal

if __name__ == "__main__":  # before any other import
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})

import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

SUBMITIT_RUNNER = ["-u", "-m", "submitit.core._submit"]


def submitit_python() -> str:
    """submitit's `python` setting: this interpreter, running this file by path."""
    return f"{shlex.quote(sys.executable)} -u {shlex.quote(str(Path(__file__).absolute()))}"


def main(argv: list[str]) -> None:
    if argv[:3] != SUBMITIT_RUNNER or len(argv) != 4:
        raise SystemExit(f"{Path(__file__).name}: expected {' '.join(SUBMITIT_RUNNER)} FOLDER after it "
                         f"(submitit's command line), got {argv}")
    sys.argv = [sys.argv[0], argv[3]]
    from submitit.core.submission import submitit_main

    submitit_main()


if __name__ == "__main__":
    # Run by path, Python put this file's folder first on sys.path: its modules are not top-level ones.
    if sys.path and Path(sys.path[0]).absolute() == Path(__file__).absolute().parent:
        del sys.path[0]
    main(sys.argv[1:])
