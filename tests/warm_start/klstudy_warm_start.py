"""A warm start for the suite's job processes: `python -m trainer|eval ...` (and `python -m sweep track|report`)
forked from a process that has already imported torch, transformers and lm-eval (MLflow, SciPy and matplotlib),
in place of a fresh interpreter that imports them again.

Why: the suite's studies start a few hundred such processes, and each spent 4-9 s of CPU importing the same
libraries before doing a second of work. Only the test suite uses this (tests/conftest.py turns it on; the
product's commands are unchanged), and what runs is the job's own code, from the same interpreter.

How a job process goes:
- Python runs this directory's sitecustomize (PYTHONPATH), which calls `hand_off`. A process that is not
  `python -m trainer|eval` or `python -m sweep track|report` (ONLY, NEVER), or is one rank of a distributed
  launch, goes on as usual.
- The *zygote* for the process's module and environment is found by a key: the interpreter (through its
  environment's real path), the module and every environment variable but those that differ between one
  study's jobs and that no library reads at import (IGNORED: a SLURM job's own variables among them). A
  library that reads a variable as it is imported (HF_HUB_OFFLINE, OMP_NUM_THREADS, ...) thus finds the
  job's own value. No zygote for the key: this process asks the *broker* to start one, and waits for it to
  have imported. The broker, started by tests/conftest.py outside of every job, is the zygotes' parent: a
  zygote asked for by a SLURM job does not end with that job's processes.
- The zygote freezes what its imports made (`gc.freeze`) before it forks: a worker's collections, the last
  ones as it exits among them, then skip the libraries' objects. Walking them took about 1.2 s of CPU as
  each worker of the trainer or lm-eval exited, and wrote to memory the worker shared with its zygote.
- The process (the *client*) sends the zygote its argv, environment, working directory, umask and ignored
  signals, and its stdin, stdout and stderr as file descriptors. The zygote forks a *reaper*, which says it
  is ready. Only then does the client say go, and from then on it is committed: it never starts the module
  itself. The reaper forks the *worker* only on that go (a client that gave up waiting closes its socket and
  goes on as usual, and the reaper ends: one job never runs twice). The worker takes all of these, and runs
  the module as `python -m` would.
- The client stays as the job's process. Signals sent to it (TERM, INT, HUP, QUIT, USR1, USR2) go on to the
  worker. When the worker ends, the client ends the same way: its exit status, or killed by its signal.
  When the client dies (SIGKILL to a job's process group), the reaper kills the worker's process group.
  When the client is stopped (SIGSTOP, Ctrl-Z, `scontrol suspend`), so is the worker's group, until the
  client continues.

Anything that goes wrong before the worker starts falls back to the ordinary start, so a broken warm start
costs time, never a result. KLSTUDY_WARM_START=0 turns it off.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys

DIR_VARIABLE = "KLSTUDY_WARM_DIR"  # where zygotes keep their sockets, pids and logs; set by tests/conftest.py
BROKER = "broker.sock"  # in that directory: the broker, which starts zygotes
MODULES = ("trainer", "eval", "sweep")  # the `python -m` modules handed off (KLSTUDY_WARM_MODULES: others)
# Of a module, only these commands (its first argument) are handed off: `sweep status` and `sweep fetch` import
# less (0.1 s) than their first call would wait for a new zygote's imports.
ONLY = {"sweep": ("track", "report")}
# Nor are commands with one of these arguments: a training job's follower (`sweep track --follow`) installs its
# SIGUSR1 handler as it starts, before MLflow is imported; handed off, it would wait for a zygote while the job
# that signals it ends, and die of the signal.
NEVER = {"sweep": ("--follow",)}
# Environment variables that vary between the processes of one study and that nothing reads at import time.
IGNORED = frozenset({"PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PWD", "OLDPWD", "SHLVL", "_",
                     "KLSTUDY_WARM_READY_S",
                     # MLflow's client reads these when it calls a server (the tracking tests give each process
                     # its server and credentials), torch this one when it compiles (set in a test process by
                     # the first that compiles, and inherited by every process it starts from then on)
                     "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                     "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "TORCHINDUCTOR_CACHE_DIR"})
# A SLURM job's variables (its id, node, task; submitit's folder) differ from job to job; torch, transformers,
# accelerate, lm-eval and the hub client read none of them at import (only when a run asks).
IGNORED_PREFIXES = ("SLURM_", "SLURMD_", "SUBMITIT_")
# A rank of a distributed launch keeps its own start: its ranks and its launcher's signals are what those
# tests are about.
NOT_IN = ("WORLD_SIZE", "LOCAL_RANK")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# What a zygote imports for each module (KLSTUDY_WARM_PRELOAD: other modules, comma-separated): what the
# module's commands that load a model import, in their order (one zygote per module: lm-eval, which only the
# evaluation loads, sets a variable as it loads). `name:function` also calls the function: the trainer's
# quieting sets the variables that transformers and the hub client read as they load.
_LIBRARIES = ("torch", "transformers", "transformers.models.llama.modeling_llama",
              "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto", "accelerate",
              "safetensors.torch", "yaml", "numpy")
PRELOAD = {"trainer": ("trainer.__main__:_quiet_libraries", *_LIBRARIES),
           "eval": ("eval", *_LIBRARIES, "lm_eval", "lm_eval.evaluator", "lm_eval.models.huggingface"),
           "sweep": ("sweep.report.figures:_pyplot", "sweep.tracking.experiment", "sweep.report.build", "mlflow",
                     "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store", "scipy.stats")}
STOP_POLL_S = 0.1  # how often a reaper looks whether its client is stopped
IDLE_S = 300.0  # a zygote that has forked nothing for this long exits (each holds 0.3-0.5 GB of its own)
# How long a client waits for a new zygote's imports, and then for its reaper (KLSTUDY_WARM_READY_S: a test's).
READY_S = float(os.environ.get("KLSTUDY_WARM_READY_S", "300"))
GO = struct.pack("!i", 0)  # the client's go: the worker may start (what follows are signal numbers, never 0)


def _interpreter() -> str:
    """This interpreter, named through its environment's real path: `.venv/bin/python` in a directory whose
    `.venv` is a link (each runnable doc command runs in a copy of the repository made of links) is the same
    interpreter with the same packages, and gets the same zygote."""
    inside = os.path.relpath(sys.executable, sys.prefix)
    return sys.executable if inside.startswith(os.pardir) else os.path.join(os.path.realpath(sys.prefix), inside)


def _key(module: str, environ: dict[str, str]) -> str:
    kept = sorted((k, v) for k, v in environ.items() if k not in IGNORED and not k.startswith(IGNORED_PREFIXES))
    return hashlib.sha256(json.dumps([_interpreter(), module, kept]).encode()).hexdigest()[:20]


def _wanted() -> str | None:
    """The module to hand off, if this process should be warm-started."""
    argv = getattr(sys, "orig_argv", [])
    directory = os.environ.get(DIR_VARIABLE)
    modules = os.environ.get("KLSTUDY_WARM_MODULES", ",".join(MODULES)).split(",")
    if (not directory or os.environ.get("KLSTUDY_WARM_START") == "0" or len(argv) < 3 or argv[1] != "-m"
            or argv[2] not in modules or any(name in os.environ for name in NOT_IN)):
        return None
    args = argv[3:]
    if argv[2] in ONLY and (not args or args[0] not in ONLY[argv[2]]):
        return None
    if any(arg.split("=", 1)[0] in NEVER.get(argv[2], ()) for arg in args):
        return None
    return argv[2] if os.path.isdir(directory) else None


def _send(conn: socket.socket, payload: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(payload).encode()
    message = struct.pack("!I", len(data)) + data
    if fds:
        conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        conn.sendall(message)


def _exactly(conn: socket.socket, size: int, data: bytes = b"") -> bytes:
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ConnectionError("message cut short")
        data += more
    return data


def _receive(conn: socket.socket, with_fds: int = 0) -> tuple[dict, list[int]]:
    """One message, read to its end and no further (what follows it is the client's signals, or the end)."""
    fds = array.array("i")
    head, ancillary, _, _ = conn.recvmsg(4, socket.CMSG_LEN(with_fds * fds.itemsize) if with_fds else 0)
    for level, kind, item in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(item[: len(item) - len(item) % fds.itemsize])
    (size,) = struct.unpack("!I", _exactly(conn, 4, head))
    return json.loads(_exactly(conn, size)), list(fds)


# The client: the job's own process.

def _connect(path: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        return conn
    except OSError:
        conn.close()
        return None


def _zygote_file(directory: str, key: str, suffix: str) -> str:
    """Where the zygote of `key` keeps its socket (.sock), pid (.pid) and log (.log), and its start lock (.lock)."""
    return os.path.join(directory, f"{key}{suffix}")


def _zygote_socket(directory: str, module: str, key: str) -> socket.socket | None:
    """A connection to the zygote of `key`, started (by the broker, under a lock) if there is none."""
    import fcntl
    import time

    path = _zygote_file(directory, key, ".sock")
    conn = _connect(path)
    if conn is not None:
        return conn
    with open(_zygote_file(directory, key, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _connect(path)
        if conn is not None:
            return conn
        broker = _connect(os.path.join(directory, BROKER))
        if broker is None:  # no broker: no zygote can be started outside this process's job
            return None
        with broker:
            broker.settimeout(READY_S)
            _send(broker, {"python": _interpreter(), "key": key, "module": module, "env": dict(os.environ),
                           "cwd": os.getcwd()})
            zygote = _receive(broker)[0]["pid"]
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline and _running(zygote):
            conn = _connect(path)
            if conn is not None:
                return conn
            time.sleep(0.05)
    return None


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (the broker reaps its zygotes as they end)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def hand_off() -> None:
    """Called by sitecustomize: run this `python -m trainer|eval|sweep` process in a warm worker and exit as it
    exits; return (and let Python start as usual) when it is not one, or when the warm start fails."""
    module = _wanted()
    if module is None:
        return
    try:
        conn = _zygote_socket(os.environ[DIR_VARIABLE], module, _key(module, dict(os.environ)))
    except (OSError, ValueError, KeyError):  # (a broker that answered nothing, or no pid)
        return
    if conn is None:
        return
    try:
        umask = os.umask(0)
        os.umask(umask)
        conn.settimeout(READY_S)
        ignored = [number for number in FORWARDED if signal.getsignal(number) == signal.SIG_IGN]
        _send(conn, {"module": module, "args": sys.orig_argv[3:], "env": dict(os.environ), "cwd": os.getcwd(),
                     "umask": umask, "ignored": ignored}, fds=[0, 1, 2])
        ready, _ = _receive(conn)
        if not ready.get("ready"):
            raise ValueError(ready)
        conn.settimeout(None)
        conn.sendall(GO)
    except (OSError, ValueError):
        conn.close()  # before this process starts the module itself: a reaper that is late sees EOF, not go
        return
    os._exit(_relay(conn, ignored))  # from here on this process never runs the module itself


def _relay(conn: socket.socket, ignored: list[int]) -> int:
    """Passes this process's signals on to the worker until it ends, and returns its exit status (or dies of
    its signal)."""

    def forward(number, _frame):
        try:
            conn.sendall(struct.pack("!i", number))
        except OSError:  # the reaper is gone; its end (or EOF) is what comes next
            pass

    for number in FORWARDED:
        if number not in ignored:  # a signal this process ignores, its worker ignores too
            signal.signal(number, forward)
    status = b""
    try:
        while chunk := conn.recv(64):  # the worker's end, or EOF where the reaper died without saying
            status += chunk
        end = json.loads(status)
    except (OSError, ValueError):
        end = {"exit": 1}
    if "signal" in end:
        signal.signal(end["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), end["signal"])
        return 128 + end["signal"]
    return end["exit"]


# The zygote, its reapers and its workers.

def _listen(path: str) -> socket.socket:
    """A socket listening at `path`, which appears there only once it listens."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path + ".new"):
        os.unlink(path + ".new")
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)
    return listener


def _serve(directory: str, key: str, module: str) -> dict | None:
    """Imports the libraries, then forks a reaper per connection until idle. Returns only in a worker, with
    the client's request, for the caller to run outside of every frame of this loop."""
    import gc
    import importlib
    import threading
    import time

    began, before = time.monotonic(), dict(os.environ)
    preload = os.environ.get("KLSTUDY_WARM_PRELOAD")
    for step in preload.split(",") if preload else PRELOAD.get(module, ()):
        name, _, function = step.partition(":")
        try:
            loaded = importlib.import_module(name)
            if function:
                getattr(loaded, function)()
        except Exception as error:  # noqa: BLE001 - a library that fails here fails (or not) in the worker
            print(f"warm start: not preloaded: {name}: {error!r}", file=sys.stderr, flush=True)
        if name.endswith(".__main__"):  # runpy runs it again as __main__, and warns if it finds it loaded
            sys.modules.pop(name, None)
    # What the imports did to the environment, done again in each worker (whose environment is its client's).
    changes = {key: value for key, value in os.environ.items() if before.get(key) != value}
    removed = [key for key in before if key not in os.environ]
    print(f"warm start: pid {os.getpid()} imported for {module} in {time.monotonic() - began:.1f} s, "
          f"{threading.active_count()} Python thread(s)", file=sys.stderr, flush=True)
    path, pid_path = _zygote_file(directory, key, ".sock"), _zygote_file(directory, key, ".pid")
    listener = _listen(path)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reapers end on their own; nobody waits for them
    with open(pid_path, "w") as pid_file:
        pid_file.write(str(os.getpid()))
    idle = False
    while True:
        if not select.select([listener], [], [], 0 if idle else IDLE_S)[0]:
            if idle:
                os.unlink(pid_path)  # (its pid may be another process's later)
                return None
            if os.path.exists(path):
                os.unlink(path)  # no new client from here on; those already queued are still served
            idle = True
            continue
        conn, _ = listener.accept()
        gc.freeze()  # (see the module's docstring)
        if os.fork() == 0:
            listener.close()
            request = _reap(conn)
            request["env"] = {key: value for key, value in {**request["env"], **changes}.items()
                              if key not in removed}
            return request
        conn.close()


def _reap(conn: socket.socket) -> dict:
    """The reaper: forks the worker, passes on the client's signals, and tells the client how the worker
    ended. Returns (only in the worker) the request the worker is to run."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        request, fds = _receive(conn, with_fds=3)
        _send(conn, {"ready": True})
        if _exactly(conn, len(GO)) != GO:
            raise ValueError("no go")
    except (OSError, ValueError):  # the client gave up (and runs the module itself) or is gone
        os._exit(1)
    worker = os.fork()
    if worker == 0:
        conn.close()
        os.setpgid(0, 0)  # the worker's group stands for the job's: killed whole when the client dies
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return request
    try:
        _supervise(conn, worker, fds)
    finally:
        os._exit(0)  # a reaper never goes back to the zygote's loop


def _supervise(conn: socket.socket, worker: int, fds: list[int]) -> None:
    """The reaper's work: the client's signals passed on to the worker, and the worker's end told."""
    try:
        os.setpgid(worker, worker)  # (both sides: killpg below must find the group even if the worker is slow)
    except OSError:
        pass
    for fd in fds:
        os.close(fd)
    client = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    pidfd, stopped = os.pidfd_open(worker), False
    while True:
        readable = select.select([conn, pidfd], [], [], STOP_POLL_S)[0]
        if not readable:  # a stop is no signal a process can pass on: the reaper sees it, and stops the job too
            if _stopped(client) != stopped:
                stopped = not stopped
                try:
                    os.killpg(worker, signal.SIGSTOP if stopped else signal.SIGCONT)
                except ProcessLookupError:
                    pass
            continue
        if pidfd in readable:
            break
        try:
            data = conn.recv(4)
        except OSError:
            data = b""
        if len(data) < 4:  # the client is gone: so is the job's process group
            try:
                os.killpg(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        try:
            os.kill(worker, struct.unpack("!i", data)[0])
        except ProcessLookupError:
            pass
    _, status = os.waitpid(worker, 0)
    end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
    try:
        conn.sendall(json.dumps(end).encode())
    except OSError:
        pass


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _run_worker(request: dict) -> None:
    """Becomes `python -m <module> <args>` in the client's directory and environment."""
    import random
    import runpy

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for number in FORWARDED:  # the client's ignored signals (inherited, as ignored signals are), not the zygote's
        default = signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
        signal.signal(number, signal.SIG_IGN if number in request["ignored"] else default)
    sys.path[0] = request["cwd"]  # what `python -m` puts first
    for stream, fd in ((sys.stdin, 0), (sys.stdout, 1)):
        stream.reconfigure(line_buffering=os.isatty(fd))
    random.seed()  # each process its own, as a fresh interpreter would have
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


# The broker.

def start_broker(directory: str) -> int:
    """Starts the broker of `directory` as a daemon (its own session, reparented away from the caller) and
    returns its pid once it listens. Run as `python klstudy_warm_start.py --broker DIRECTORY`."""
    ready_read, ready_write = os.pipe()
    if os.fork() != 0:
        os.close(ready_write)
        with os.fdopen(ready_read) as ready:
            return int(ready.read() or "0")
    os.close(ready_read)
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    try:
        listener = _listen(os.path.join(directory, BROKER))
        with open(os.path.join(directory, "broker.pid"), "w") as pid_file:
            pid_file.write(str(os.getpid()))
        os.write(ready_write, str(os.getpid()).encode())
    finally:
        os.close(ready_write)
    _broker(listener, directory)


def _zygote_command(directory: str, request: dict) -> list[str]:
    """The command of the zygote a client asks the broker for, which the broker writes itself: this file run
    by an interpreter, for a key in the broker's directory. Anything else is refused (ValueError)."""
    python, key, module = request["python"], request["key"], request["module"]
    if not (all(isinstance(value, str) for value in (python, key, module)) and os.path.isabs(python)
            and os.path.basename(os.path.realpath(python)).startswith("python") and os.access(python, os.X_OK)
            and key.isalnum() and all(part.isidentifier() for part in module.split("."))):
        raise ValueError(f"not a zygote: {python!r} {key!r} {module!r}")
    return [python, os.path.abspath(__file__), directory, key, module]


def _broker(listener: socket.socket, directory: str) -> None:
    """Starts each zygote asked for, as its child: in the asking process's environment and directory, but not
    in its process tree, which SLURM ends with the job."""
    import subprocess

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # zygotes end on their own; nobody waits for them
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                request, _ = _receive(conn)
                command = _zygote_command(directory, request)
                with open(_zygote_file(directory, request["key"], ".log"), "ab") as log:
                    zygote = subprocess.Popen(command, env=request["env"], cwd=request["cwd"],
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                              start_new_session=True, preexec_fn=_child_signals)
                _send(conn, {"pid": zygote.pid})
            except (OSError, ValueError, KeyError, TypeError):
                pass  # the client gets no pid, and starts as usual


def _child_signals() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (ignored in the broker, and inherited as ignored)


if __name__ == "__main__":
    if sys.argv[1] == "--broker":
        broker = start_broker(sys.argv[2])
        print(broker)
        sys.exit(0 if broker else 1)
    worker_request = _serve(*sys.argv[1:4])
    if worker_request is not None:
        _run_worker(worker_request)
