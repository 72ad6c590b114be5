"""A pool of worker processes in which every call has a deadline.

math-verify's own timeouts use signal.alarm, which works only in a main thread; sympy can also hang
or recurse without bound on hostile input. Here each call runs in a separate worker process, and a
worker still busy at its deadline is killed and replaced, so a call costs at most `timeout` seconds
and can never take the caller down with it.

Workers are plain `python -m eval.workers module:function` subprocesses talking length-prefixed
pickle over their stdin/stdout. Unlike multiprocessing's spawn or forkserver, this never re-imports
the host's __main__ (a notebook, stdin, another tool's CLI) and never forks the host's threads.

Workers ignore SIGTERM and SIGINT (held back as they start, ignored once they serve). SLURM and the
submitit executor stop a job with SIGTERM to its whole process group; the trainer answers it by
finishing its step and checkpointing, and workers that died of the same signal would have scored that
step's calls 0. Their parent stops them: it closes their stdin (an idle worker then exits) or kills
them at a deadline. They stay in the job's process group, so the SIGKILL that ends a job that outlived
its grace reaches them too; in a session of their own they would escape it and the executor's wait for
the group. A parent killed outright leaves a busy worker to finish its call (EOF or a broken pipe then
ends it); only a call hung in native code waits for that SIGKILL.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, BinaryIO

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<Q")
JOB_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # what stops a job (SLURM) or a terminal's foreground group


@dataclass(frozen=True)
class Outcome:
    """The result of one call: status "ok" (with value), "timeout" or "error" (with message)."""

    status: str
    value: Any = None
    message: str = ""


class WorkerStartError(RuntimeError):
    """No worker could import its target in time, or a worker died while starting."""


def _write_frame(stream: BinaryIO, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: BinaryIO) -> object:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("worker closed its pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("worker closed its pipe mid-frame")
    return pickle.loads(data)


def _serve(target: str) -> None:
    """Worker side: run `module:function` on every (index, args) frame until stdin closes."""
    for number in JOB_SIGNALS:  # one that came while Python started was held back, and is dropped here
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # whatever fn prints must not corrupt the frames
    _write_frame(stdout, "ready")  # imports done: from now on a call's time is the call's own
    while True:
        try:
            index, args = _read_frame(stdin)
        except EOFError:
            return
        # plain tuples only: this module runs as __main__ here, so its classes would not unpickle
        try:
            reply = (index, "ok", fn(*args), "")
        except BaseException as error:  # noqa: BLE001 - everything a hostile input can raise
            reply = (index, "error", None, f"{type(error).__name__}: {str(error)[:200]}")
        _write_frame(stdout, reply)


class _Worker:
    def __init__(self, target: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # The worker starts with the job's signals blocked (a blocked mask survives exec) until `_serve`
        # ignores them: a signal in the interpreter's start would kill it. This thread's mask alone
        # changes, so a signal meant for this process waits at most for the Popen call, or goes elsewhere.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "eval.workers", target],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.task: int | None = None
        self.deadline = 0.0
        self.ready = False  # a call's deadline starts only once the worker has imported its target
        self.started = time.monotonic()

    def send(self, index: int, args: tuple) -> None:
        _write_frame(self.process.stdin, (index, args))

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class DeadlinePool:
    """Runs `module:function` on many argument tuples in `workers` processes, each within `timeout` s.

    `target` names a module-level function ("eval.verify:math_equivalent"); its arguments and result
    must pickle.
    """

    STARTUP_TIMEOUT = 120.0  # seconds a worker may take to import its target, even on a loaded machine

    def __init__(self, target: str, workers: int = 2, timeout: float = 5.0) -> None:
        if workers < 1 or timeout <= 0:
            raise ValueError(f"need workers >= 1 and timeout > 0, got {workers} and {timeout}")
        self.target = target
        self.timeout = timeout
        self._workers = [_Worker(target) for _ in range(workers)]

    def map(self, calls: list[tuple]) -> list[Outcome]:
        """One Outcome per argument tuple, in order. Never raises for what a call does."""
        results: list[Outcome | None] = [None] * len(calls)
        queue = deque(range(len(calls)))
        while queue or any(w.task is not None for w in self._workers):
            if queue and not any(w.ready for w in self._workers):
                self._wait_for_startup()
            for worker in self._workers:
                if worker.ready and worker.task is None and queue:
                    index = queue.popleft()
                    worker.task, worker.deadline = index, time.monotonic() + self.timeout
                    try:
                        worker.send(index, calls[index])
                    except OSError:  # it died since its last call: replace it and run the call again
                        self._replace(worker)
                        queue.appendleft(index)
            busy = [w for w in self._workers if w.task is not None]
            if not busy:
                continue
            starting = [w for w in self._workers if not w.ready]
            wait_for = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            readable, _, _ = select.select([w.process.stdout for w in busy + starting], [], [], wait_for)
            for worker in starting:
                if worker.process.stdout in readable:
                    self._mark_ready(worker)
            for worker in busy:
                if worker.process.stdout in readable:
                    try:
                        index, status, value, message = _read_frame(worker.process.stdout)
                        results[index] = Outcome(status, value, message)
                        worker.task = None
                    except Exception as error:  # noqa: BLE001 - it died (a crash in native code) or garbled
                        results[worker.task] = Outcome("error", message=f"worker process failed: {error!r}")
                        self._replace(worker)
                elif time.monotonic() >= worker.deadline:
                    results[worker.task] = Outcome("timeout", message=f"over {self.timeout:g} s")
                    self._replace(worker)
        return [r if r is not None else Outcome("error", message="lost") for r in results]

    def _wait_for_startup(self) -> None:
        """Block until some starting worker has imported its target: startup is no call's time."""
        starting = [w for w in self._workers if not w.ready]
        deadline = min(w.started for w in starting) + self.STARTUP_TIMEOUT
        readable, _, _ = select.select([w.process.stdout for w in starting], [], [],
                                       max(0.0, deadline - time.monotonic()))
        if not readable:
            raise WorkerStartError(f"no worker for {self.target} started within {self.STARTUP_TIMEOUT:g} s")
        for worker in starting:
            if worker.process.stdout in readable:
                self._mark_ready(worker)

    def _mark_ready(self, worker: _Worker) -> None:
        try:
            ready = _read_frame(worker.process.stdout) == "ready"
        except (EOFError, pickle.UnpicklingError):
            ready = False
        if not ready:
            raise WorkerStartError(f"a worker for {self.target} failed to start: can it be imported?")
        worker.ready = True

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self.target)

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.process.stdin.close()
                worker.process.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
            if worker.process.poll() is None:
                worker.kill()
        self._workers = []

    def __enter__(self) -> "DeadlinePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
