"""The suite's warm start (tests/warm_start): a `python -m` process handed to a worker forked from a zygote
behaves as the process would have: its arguments, directory, environment, stdin and stdout, its exit status,
the signals sent to it, its death; libraries imported ahead see the environment the process has; a
process that is not to be warm-started, or whose warm start is off, starts as usual. A probe module stands
in for the trainer, and a small module for the libraries a zygote imports, so that these tests take seconds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import start_warm_broker

from snakemake_executor_plugin_submitit.command import live_stat

WARM_START = Path(__file__).resolve().parent / "warm_start"


def warm_start_module():
    """tests/warm_start/klstudy_warm_start.py, loaded by its path (for its message framing)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("klstudy_warm_start", WARM_START / "klstudy_warm_start.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROBE = """
import json, os, signal, sys, time
import imported_env
mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(),
                      "value": os.environ.get("PROBE_VALUE"), "at_import": imported_env.VALUE,
                      "job": os.environ.get("SLURM_JOB_ID"), "stdin": sys.stdin.read()}))
    sys.exit(3)
if mode == "gc":  # what the zygote imported is out of the cyclic collector's reach; what the job makes is not
    import gc
    made, tracked = ["made here"], gc.get_objects()
    print(json.dumps({"frozen": gc.get_freeze_count(), "enabled": gc.isenabled(),
                      "imported": any(o is imported_env.MARK for o in tracked),
                      "made": any(o is made for o in tracked)}))
    sys.exit(0)
if mode == "once":
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\\n")
    sys.exit(0)
if mode == "count":
    for tick in range(10**6):
        with open(sys.argv[2] + ".new", "w") as f:
            f.write(str(tick))
        os.replace(sys.argv[2] + ".new", sys.argv[2])
        time.sleep(0.05)
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
with open(sys.argv[2], "w") as f:
    f.write(str(os.getpid()))
if mode == "abort":
    os.abort()
time.sleep(60)
"""


@pytest.fixture
def warm(tmp_path):
    """An environment whose `python -m probe` starts warm, with its own zygotes (stopped at the end)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "probe.py").write_text(PROBE)
    (tmp_path / "lib" / "imported_env.py").write_text("import os\nVALUE = os.environ.get('PROBE_VALUE')\n"
                                                      "MARK = ['imported ahead']\n")
    directory = Path(tempfile.mkdtemp(prefix="warm-test-"))  # short: a socket's path has 107 bytes
    assert start_warm_broker(str(directory))
    env = {**os.environ, "KLSTUDY_WARM_DIR": str(directory), "KLSTUDY_WARM_MODULES": "probe",
           "KLSTUDY_WARM_PRELOAD": "imported_env", "PROBE_VALUE": "a",
           "PYTHONPATH": os.pathsep.join([str(WARM_START), str(tmp_path / "lib")])}
    env.pop("KLSTUDY_WARM_START", None)
    yield env
    for pid_file in directory.glob("*.pid"):
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
    shutil.rmtree(directory, ignore_errors=True)


def probe(env, *args, cwd=None, **popen):
    return subprocess.Popen([sys.executable, "-m", "probe", *args], env=env, cwd=cwd, **popen)


def zygotes(env) -> list[str]:
    return sorted(path.name for path in Path(env["KLSTUDY_WARM_DIR"]).glob("*.sock") if path.name != "broker.sock")


def zygote_pids(env) -> list[int]:
    return [int(path.read_text()) for path in Path(env["KLSTUDY_WARM_DIR"]).glob("*.pid") if path.name != "broker.pid"]


def report(env, cwd):
    process = probe(env, "report", "x y", cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate("hello", timeout=120)
    return process, json.loads(out)


def wait_for_file(path: Path) -> int:
    deadline = time.monotonic() + 120
    while not (path.is_file() and path.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(path.read_text())


def gone(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while live_stat(Path(f"/proc/{pid}/stat")) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_warm_process_keeps_its_arguments_directory_environment_stdio_and_exit_status(warm, tmp_path):
    for _ in range(2):
        process, seen = report(warm, tmp_path)
        assert process.returncode == 3
        assert seen == {"argv": ["report", "x y"], "cwd": str(tmp_path), "pid": seen["pid"], "value": "a",
                        "at_import": "a", "job": None, "stdin": "hello"}
        assert seen["pid"] != process.pid  # it ran in a worker, not in the process that was started
    assert len(zygotes(warm)) == 1  # the second one was forked from the first one's zygote


def test_libraries_imported_ahead_see_the_environment_of_the_process(warm, tmp_path):
    report(warm, tmp_path)
    _, seen = report({**warm, "PROBE_VALUE": "b"}, tmp_path)
    assert (seen["value"], seen["at_import"]) == ("b", "b")
    assert len(zygotes(warm)) == 2  # another environment, another zygote
    _, seen = report({**warm, "PYTEST_CURRENT_TEST": "another test"}, tmp_path)
    assert len(zygotes(warm)) == 2  # a variable nothing reads at import does not make a third


def test_a_worker_ends_without_collecting_what_its_zygote_imported(warm, tmp_path):
    """The zygote freezes its objects (gc.freeze) before it forks: the collections a worker makes, the last
    ones as it exits among them, skip the libraries' millions of objects (for the trainer and lm-eval they
    took about 1.2 s of CPU per job) and leave the memory the worker shares with its zygote untouched."""
    process = probe(warm, "gc", stdout=subprocess.PIPE, text=True)
    seen = json.loads(process.communicate(timeout=120)[0])
    assert process.returncode == 0
    assert seen["frozen"] > 0 and seen["enabled"]
    assert not seen["imported"] and seen["made"]  # an object from the zygote's imports is frozen, a new one not


def test_a_signal_to_the_process_reaches_the_worker_and_its_exit_is_the_process_exit(warm, tmp_path):
    process = probe(warm, "term", str(tmp_path / "pid"))
    worker = wait_for_file(tmp_path / "pid")
    assert worker != process.pid
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 75


IGNORE, DEFAULT = signal.SIG_IGN, signal.SIG_DFL


def test_a_process_ignores_the_signals_it_inherited_as_ignored_and_no_others(warm, tmp_path):
    """Ignored signals are inherited: a zygote started by a process that ignored SIGINT (a pytest-xdist
    worker's child, say) must not make a later process, which did not, ignore Ctrl-C."""
    first = probe(warm, "sleep", str(tmp_path / "first"), preexec_fn=lambda: signal.signal(signal.SIGINT, IGNORE))
    wait_for_file(tmp_path / "first")
    first.send_signal(signal.SIGINT)
    time.sleep(1)
    assert first.poll() is None  # ignored, as it would be in the process itself
    first.kill()
    first.wait(timeout=60)
    second = probe(warm, "sleep", str(tmp_path / "second"), stderr=subprocess.PIPE, text=True,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, DEFAULT))  # (xdist's workers ignore it)
    wait_for_file(tmp_path / "second")
    second.send_signal(signal.SIGINT)
    _, stderr = second.communicate(timeout=60)
    assert second.returncode == -signal.SIGINT and "KeyboardInterrupt" in stderr
    assert len(zygotes(warm)) == 1


def test_a_process_that_gave_up_waiting_runs_its_module_itself_and_no_worker_runs_it_again(warm, tmp_path):
    report(warm, tmp_path)  # a zygote, started
    (zygote,) = zygote_pids(warm)
    os.kill(zygote, signal.SIGSTOP)  # it accepts nothing: the next process waits a second, gives up, runs itself
    try:
        process = probe({**warm, "KLSTUDY_WARM_READY_S": "1"}, "once", str(tmp_path / "runs"))
        assert process.wait(timeout=60) == 0
    finally:
        os.kill(zygote, signal.SIGCONT)  # now it takes that connection, late: its reaper must start nothing
    _, seen = report(warm, tmp_path)  # (taken after the late one)
    time.sleep(1)
    assert (tmp_path / "runs").read_text().split() == [str(process.pid)]
    assert seen["pid"] != process.pid


def test_a_worker_killed_by_a_signal_kills_the_process_with_it(warm, tmp_path):
    process = probe(warm, "abort", str(tmp_path / "pid"))
    assert process.wait(timeout=120) == -signal.SIGABRT


def test_a_killed_process_takes_its_worker_and_the_workers_children_with_it(warm, tmp_path):
    process = probe(warm, "sleep", str(tmp_path / "pid"), start_new_session=True)
    worker = wait_for_file(tmp_path / "pid")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert gone(worker)


def test_off_not_wanted_or_without_a_broker_a_process_starts_as_usual(warm, tmp_path):
    no_broker = tempfile.mkdtemp(prefix="warm-test-")
    try:
        for env in ({**warm, "KLSTUDY_WARM_START": "0"}, {**warm, "WORLD_SIZE": "2"}, {**warm, "LOCAL_RANK": "0"},
                    {**warm, "KLSTUDY_WARM_DIR": no_broker}):
            process, seen = report(env, tmp_path)
            assert (process.returncode, seen["pid"]) == (3, process.pid)
        assert zygotes(warm) == [] and not list(Path(no_broker).glob("*.sock"))
    finally:
        shutil.rmtree(no_broker)


def test_of_the_sweep_commands_only_track_and_report_start_warm(warm, tmp_path):
    """`sweep status` and `sweep fetch` import less than a zygote's start would cost them, and a training job's
    follower (`track --follow`) must have its signal handler before anything is imported: they start as usual."""
    env = {key: value for key, value in warm.items() if key != "KLSTUDY_WARM_MODULES"}  # the suite's modules
    root = Path(__file__).resolve().parent.parent

    def sweep(*args):
        done = subprocess.run([sys.executable, "-m", "sweep", *args], env=env, cwd=root, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr

    for args in (("--help",), ("status", "--help"), ("track", "--follow", "run", "--help"),
                 ("track", "--follow=run", "--help")):
        sweep(*args)
    assert zygotes(env) == []
    sweep("track", "--help")
    sweep("report", "--help")
    assert len(zygotes(env)) == 1


def test_the_jobs_of_a_slurm_study_share_a_zygote_that_none_of_their_process_trees_holds(warm, tmp_path):
    """SLURM ends a job by killing its processes: the zygote, which later jobs fork from, is the broker's child.
    A job's own variables (its id, submitit's folder) do not make a zygote of their own."""
    for job in ("7", "8"):
        process, seen = report({**warm, "SLURM_JOB_ID": job, "SUBMITIT_FOLDER": f"/jobs/{job}"}, tmp_path)
        assert (process.returncode, seen["job"]) == (3, job) and seen["pid"] != process.pid
    assert len(zygotes(warm)) == 1
    directory = Path(warm["KLSTUDY_WARM_DIR"])
    (zygote,) = zygote_pids(warm)
    parent = int(live_stat(Path(f"/proc/{zygote}/stat"))[1])
    assert parent == int((directory / "broker.pid").read_text())


def test_the_broker_starts_only_its_own_zygote_command(warm, tmp_path):
    """Whatever a request says, the broker runs this directory's klstudy_warm_start.py under an interpreter
    (it writes the command itself), or nothing."""
    touch = shutil.which("touch")
    common = {"env": {}, "cwd": str(tmp_path), "log": str(tmp_path / "log")}
    send = warm_start_module()._send  # the module's own framing of a message
    for request in ({"argv": [touch, str(tmp_path / "ran")], **common},  # a command of the request's own
                    {"python": touch, "key": "a1", "module": "probe", **common},  # not an interpreter
                    {"python": sys.executable, "key": "../a1", "module": "probe", **common},  # a socket elsewhere
                    {"python": sys.executable, "key": "a1", "module": "probe; touch ran", **common},
                    {"python": [touch], "key": "a1", "module": "probe", **common},  # not a string
                    [touch, "ran"]):  # not a request
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(Path(warm["KLSTUDY_WARM_DIR"]) / "broker.sock"))
            send(conn, request)
            assert conn.recv(1) == b"", request  # closed with no zygote's pid
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lib"] and zygote_pids(warm) == []
    process, _ = report(warm, tmp_path)  # and the broker still serves
    assert process.returncode == 3 and len(zygote_pids(warm)) == 1


def test_a_stopped_process_stops_its_worker_until_it_continues(warm, tmp_path):
    """A stop (SIGSTOP, Ctrl-Z, `scontrol suspend`) cannot be caught and passed on: the reaper sees it."""
    ticks = tmp_path / "ticks"
    process = probe(warm, "count", str(ticks))
    try:
        wait_for_file(ticks)
        process.send_signal(signal.SIGSTOP)
        time.sleep(1)
        stopped_at = int(ticks.read_text())
        time.sleep(1)
        assert int(ticks.read_text()) == stopped_at
        process.send_signal(signal.SIGCONT)
        time.sleep(1)
        assert int(ticks.read_text()) > stopped_at + 5
    finally:
        process.kill()
        process.wait(timeout=60)


def test_a_later_sitecustomize_on_the_path_still_runs(warm, tmp_path):
    (tmp_path / "spy").mkdir()
    (tmp_path / "spy" / "sitecustomize.py").write_text(f"open({str(tmp_path / 'spied')!r}, 'w').close()\n")
    process, _ = report({**warm, "PYTHONPATH": warm["PYTHONPATH"] + os.pathsep + str(tmp_path / "spy")}, tmp_path)
    assert process.returncode == 3 and (tmp_path / "spied").exists()
