"""One trainer per run directory: a lease with a heartbeat.

A training process holds `<run>/lease.<generation>.json` while it runs: host, pid, the process's
start time (a recycled pid is not the same process), the SLURM job if any, and a heartbeat that a
thread rewrites every HEARTBEAT_S seconds. The file is removed on the way out.

A second trainer on a directory whose lease is live does not write anything: it stops with one
error that names the holder (LeaseHeld). It stops rather than waits because a waiting job holds
its allocation, GPUs included, doing nothing for as long as the holder trains; the case where
waiting would help, a study rerun while its previous jobs still run, is handled where it starts:
the SLURM executor adopts those jobs instead of submitting them again.

A lease is stale, and is taken over with one log line, when its holder
- ran on this host and its process is gone;
- ran in a SLURM job that SLURM no longer runs (`squeue`), or in this very job before a requeue;
- ran elsewhere and has not renewed its heartbeat for STALE_AFTER_S seconds (10 minutes, 20
  heartbeats: longer than a file system's usual stalls, short enough for a study to go on).

Taking over claims the next generation: its file is linked into place, which succeeds for exactly
one process (no lock is involved). Before it writes metrics, a checkpoint or the final model, a
trainer checks that its lease is still the newest (`check`): a holder that was taken for dead
(stopped for longer than the bound, say) stops there, without writing (LeaseLost).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0
PREFIX = "lease."
SLURM_ALIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING"}


class LeaseHeld(ValueError):
    """The run directory is being trained by another live process."""


class LeaseLost(ValueError):
    """Another trainer took this run directory over (this one was taken for dead)."""


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), or None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19]  # field 22 of stat(5), counted after the command name's ")"


def process_alive(pid: int, start_time: str | None) -> bool:
    """Whether process `pid` of this host runs, and is the one that started at `start_time`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return start_time is None or process_start_time(pid) in (None, start_time)


def slurm_job() -> str | None:
    """This process's SLURM job as squeue names it (an array task: <array job>_<task>), or None."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def slurm_state(job: str) -> str | None:
    """The job's state as squeue shows it ("" once it has left the queue), or None without squeue."""
    try:
        shown = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if shown.returncode != 0:
        return "" if "Invalid job id" in shown.stderr else None
    return shown.stdout.split()[0] if shown.stdout.split() else ""


def describe(holder: dict[str, Any]) -> str:
    job = f" (SLURM job {holder['slurm_job']})" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}"


def why_stale(holder: dict[str, Any], now: float | None = None) -> str | None:
    """Why a lease's holder is taken for dead, or None when it may be alive."""
    age = (now or time.time()) - float(holder.get("heartbeat", 0))
    if holder.get("host") == socket.gethostname():
        if process_alive(int(holder.get("pid", -1)), holder.get("start_time")):
            return None
        return "its process is gone"
    job = holder.get("slurm_job")
    if job and job == slurm_job():
        return "it ran in this SLURM job before a requeue"
    if job and (state := slurm_state(job)) is not None and state not in SLURM_ALIVE:
        return f"its SLURM job is {state.lower() or 'no longer queued'}"
    if age > STALE_AFTER_S:
        return f"its last heartbeat is {age:.0f} s old (the bound: {STALE_AFTER_S:.0f} s)"
    return None


def _generations(directory: Path) -> list[int]:
    found = []
    for path in directory.glob(f"{PREFIX}*.json"):
        number = path.name[len(PREFIX):-len(".json")]
        if number.isdigit():
            found.append(int(number))
    return sorted(found)


def current_holder(directory: Path) -> dict[str, Any] | None:
    """The newest lease's record in `directory` (None if no trainer holds or held it), read only."""
    generations = _generations(Path(directory)) if Path(directory).is_dir() else []
    return _read(Path(directory) / f"{PREFIX}{generations[-1]}.json") if generations else None


def seems_alive(holder: dict[str, Any], now: float | None = None) -> bool:
    """Whether a lease's holder looks alive from its file alone (no squeue: a study's status reads hundreds):
    on this host, its process runs; elsewhere, its heartbeat is fresher than STALE_AFTER_S."""
    if holder.get("host") == socket.gethostname():
        return process_alive(int(holder.get("pid", -1)), holder.get("start_time"))
    return (now or time.time()) - float(holder.get("heartbeat", 0)) <= STALE_AFTER_S


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Lease:
    """A held lease; `acquire` takes one, `release` gives it back."""

    directory: Path
    generation: int
    record: dict[str, Any]
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.directory / f"{PREFIX}{self.generation}.json"

    @classmethod
    def acquire(cls, directory: Path) -> "Lease":
        """This process's lease on `directory`; LeaseHeld if a live trainer holds it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        while True:
            generations = _generations(directory)
            holder = _read(directory / f"{PREFIX}{generations[-1]}.json") if generations else None
            reason = None
            if holder is not None:
                reason = why_stale(holder)
                if reason is None:
                    age = time.time() - float(holder.get("heartbeat", 0))
                    raise LeaseHeld(
                        f"{directory} is being trained by {describe(holder)}, heartbeat {age:.0f} s ago: two "
                        "trainers would interleave its metrics and overwrite each other's checkpoints. Let it "
                        f"finish, or stop it; a dead holder's lease is taken over (on another host: after "
                        f"{STALE_AFTER_S:.0f} s without a heartbeat, or once SLURM no longer runs its job)")
            elif generations:  # a lease file being written, or torn: its writer is not trusted
                reason = "its lease file cannot be read"
            lease = cls(directory, generations[-1] + 1 if generations else 0, {})
            if lease._publish():
                if reason is not None:
                    who = describe(holder) if holder else f"{PREFIX}{generations[-1]}.json"
                    log.warning("taking over %s from %s: %s", directory, who, reason)
                for old in generations:
                    (directory / f"{PREFIX}{old}.json").unlink(missing_ok=True)
                lease._start_heartbeat()
                return lease

    def _publish(self) -> bool:
        now = time.time()
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": process_start_time(os.getpid()),
                       "slurm_job": slurm_job(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "heartbeat": now,
                       "token": uuid.uuid4().hex}
        tmp = self.directory / f".{PREFIX}{self.record['token']}"
        tmp.write_text(json.dumps(self.record) + "\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def held(self) -> bool:
        """Whether this lease is still the newest, and still this process's."""
        generations = _generations(self.directory)
        current = _read(self.path)
        return bool(generations) and generations[-1] == self.generation and current is not None \
            and current.get("token") == self.record["token"]

    def check(self) -> None:
        """Raise LeaseLost if another trainer has taken the directory over."""
        if not self.held():
            newest = _generations(self.directory)
            holder = _read(self.directory / f"{PREFIX}{newest[-1]}.json") if newest else None
            raise LeaseLost(f"{self.directory} was taken over by {describe(holder) if holder else 'another trainer'} "
                            "while this trainer was taken for dead; this one stops without writing")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.held():
                return
            self.record["heartbeat"] = time.time()
            tmp = self.directory / f".{PREFIX}{self.record['token']}"
            tmp.write_text(json.dumps(self.record) + "\n")
            os.replace(tmp, self.path)

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S)
        current = _read(self.path)
        if current is not None and current.get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)
