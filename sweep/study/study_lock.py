"""Who holds a study directory's Snakemake lock, and releasing it when its holder died.

Snakemake locks its working directory while it runs and unlocks it on the way out. A snakemake
killed hard (SIGKILL, the OOM killer, a closed login session) leaves the lock behind, and the next
run fails with LockException until someone runs `--unlock`. Snakemake does not record who held the
lock, so it cannot tell a dead holder from a live one. This module does:

- `claim()`, from the Snakefile's `onstart` (the lock is held by then), records host, pid, the
  process's start time (a recycled pid is not the same process) and the command line;
- `release()`, from `onsuccess` and `onerror`, removes the record with the lock;
- `check()`, while the Snakefile is parsed (before Snakemake locks), finds a record left behind.
  Its holder dead on this host: the lock is released (`snakemake ... --unlock`) with one line
  that says so (a Ctrl-C'd run may leave a record but no lock: releasing is then a no-op).
  Alive, or on another host (which cannot be checked from here): one error with the reason and
  the exact `--unlock` command to run if the holder is in fact gone.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from sweep.study import configfiles
from trainer.lease import process_alive as _alive
from trainer.lease import process_start_time as _start_time

RECORD = Path(".snakemake") / "klstudy-lock-holder.json"  # in Snakemake's working directory
SKIP = "KLSTUDY_SKIP_LOCK_CHECK"  # set for the nested `--unlock`, which parses the Snakefile too
# Options after which Snakemake takes no lock: nothing to check, nothing to refuse.
NO_LOCK_OPTIONS = {"-n", "--dry-run", "--dryrun", "--unlock", "--nolock", "--list-rules", "--summary",
                   "--detailed-summary", "--lint"}


class StudyLocked(RuntimeError):
    """The study directory is locked by a snakemake that may still be running."""


def claim(argv: list[str], directory: Path = Path(".")) -> None:
    """Record this process as the lock's holder."""
    path = Path(directory) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": _start_time(os.getpid()),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": list(argv)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def release(directory: Path = Path(".")) -> None:
    """Remove the record, if this process wrote it."""
    path = Path(directory) / RECORD
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def unlock_command(snakefile: Path, directory: Path, files: list[Path]) -> list[str]:
    """The command that releases a study directory's lock, with absolute paths: it runs from anywhere. The
    config files follow one --configfile (sweep.study.configfiles): the study grown by an override file is both."""
    configs = configfiles.arguments(files, absolute=True) if files else []
    return [sys.executable, "-m", "snakemake", "--snakefile", str(Path(snakefile).resolve()),
            "--directory", str(Path(directory).resolve()), *configs, "--unlock"]


def check(argv: list[str], unlock: list[str], directory: Path = Path(".")) -> str | None:
    """Before Snakemake locks (`argv`: its command line; `unlock`: `unlock_command`'s): release a lock
    whose holder died on this host (a line saying so is returned), or raise StudyLocked for one that
    may be held. None: nothing was left behind."""
    if os.environ.get(SKIP) == "1":
        return None
    path = Path(directory) / RECORD
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        path.unlink(missing_ok=True)  # a half-written record: its writer died before it held anything
        return None
    who = f"snakemake pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
    here = holder.get("host") == socket.gethostname()
    if here and not _alive(int(holder.get("pid", -1)), holder.get("start_time")):
        done = subprocess.run(unlock, env=os.environ | {SKIP: "1"}, capture_output=True, text=True)
        if done.returncode != 0:
            raise StudyLocked(f"the lock left by {who} (no longer running) could not be released: "
                              f"{done.stderr.strip()[-500:]}")
        path.unlink(missing_ok=True)
        return f"klstudy: {who} is no longer running and did not clean up: its lock, if any, is released"
    if NO_LOCK_OPTIONS & set(argv):
        return None
    reason = ("it is still running" if here else
              f"that host's processes cannot be checked from {socket.gethostname()}")
    raise StudyLocked(f"this study directory is locked by {who}: {reason}. Wait for it, or stop it; if it is "
                      f"gone, release the lock with: {shlex.join(unlock)}")
