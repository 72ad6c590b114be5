"""One trainer per run directory: the lease, its heartbeat, a second trainer, a dead holder taken over."""

import json
import logging
import signal
import socket
import time

import pytest
from run_helpers import metrics, start_cli, train_cli, wait_for_lines

from trainer import lease
from trainer.lease import Lease, LeaseHeld, LeaseLost


def write_holder(directory, generation=0, **fields):
    """A lease file as another trainer wrote it."""
    record = {"host": socket.gethostname(), "pid": 1, "start_time": None, "slurm_job": None,
              "started": "2026-11-23 06:00:00", "heartbeat": time.time(), "token": "theirs", **fields}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"lease.{generation}.json").write_text(json.dumps(record))


def test_a_live_holder_keeps_the_directory_and_is_named(tmp_path):
    held = Lease.acquire(tmp_path / "run")
    with pytest.raises(LeaseHeld, match=rf"being trained by pid \d+ on {socket.gethostname()}, started .*, "
                                        r"heartbeat \d+ s ago"):
        Lease.acquire(tmp_path / "run")
    held.release()
    assert not list((tmp_path / "run").glob("lease.*"))
    Lease.acquire(tmp_path / "run").release()


def test_stale_leases_are_taken_over_with_one_line_and_the_old_holder_stops_before_writing(tmp_path, caplog):
    run = tmp_path / "run"
    write_holder(run, host="node7", slurm_job=None, heartbeat=time.time() - 30)
    with pytest.raises(LeaseHeld, match=r"pid 1 on node7, started 2026-11-23 06:00:00, heartbeat 30 s ago"):
        Lease.acquire(run)  # another host, heard from recently: alive as far as anyone here knows
    write_holder(run, host="node7", heartbeat=time.time() - lease.STALE_AFTER_S - 5)
    with caplog.at_level(logging.WARNING, logger="trainer.lease"):
        mine = Lease.acquire(run)
    assert [r.getMessage() for r in caplog.records] == [
        f"taking over {run} from pid 1 on node7, started 2026-11-23 06:00:00: its last heartbeat is "
        f"{lease.STALE_AFTER_S + 5:.0f} s old (the bound: {lease.STALE_AFTER_S:.0f} s)"]
    assert mine.generation == 1 and [p.name for p in run.glob("lease.*")] == ["lease.1.json"]
    mine.check()

    # taken for dead while it lived (stopped for too long, say): the next check stops it
    mine.record["heartbeat"] = time.time() - lease.STALE_AFTER_S - 5
    mine.record["host"] = "node8"
    (run / "lease.1.json").write_text(json.dumps(mine.record))
    successor = Lease.acquire(run)
    with pytest.raises(LeaseLost, match=rf"taken over by pid \d+ on {socket.gethostname()}"):
        mine.check()
    mine.release()  # leaves the successor's lease alone
    successor.check()
    successor.release()


def test_a_dead_process_on_this_host_is_a_stale_holder(tmp_path):
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_holder(tmp_path / "run", pid=int(gone.stdout))
    assert lease.why_stale(json.loads((tmp_path / "run" / "lease.0.json").read_text())) == "its process is gone"
    Lease.acquire(tmp_path / "run").release()


def test_a_second_trainer_stops_naming_the_holder_and_the_next_takes_over_once_it_is_killed(warm_model, tmp_path,
                                                                                             monkeypatch):
    """Two trainers on one run directory used to both run: their metrics lines interleaved (steps
    twice) and each overwrote the other's checkpoints. The holder is stopped (SIGSTOP) while the
    second one tries, so that it is alive however slowly the second one starts."""
    monkeypatch.setenv("KLSTUDY_WARM_START", "0")  # the holder's pid and SIGSTOP: the process started here
    out = tmp_path / "run"
    steps = 30
    extra = {"train.steps": steps, "train.prompts_per_step": 2, "train.group_size": 2, "rollout.max_new_tokens": 2,
             "checkpoint.every": 5}
    first = start_cli(out, warm_model, **extra)
    wait_for_lines(out, 6, first)
    while not (out / "checkpoints" / "step_5").is_dir():  # written whole, then renamed into place
        assert first.poll() is None
        time.sleep(0.05)
    first.send_signal(signal.SIGSTOP)
    second = train_cli(out, warm_model, timeout=300, **extra)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"is being trained by pid {first.pid} on {socket.gethostname()}" in second.stderr
    assert second.stderr.count("ERROR") == 1 and "Traceback" not in second.stderr
    written = (out / "metrics.jsonl").read_text()
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert (out / "metrics.jsonl").read_text() == written  # the second one wrote nothing
    third = train_cli(out, warm_model, timeout=600, **extra)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"taking over {out} from pid {first.pid} on {socket.gethostname()}" in third.stderr
    assert "its process is gone" in third.stderr and "resumed from checkpoint step_" in third.stderr
    assert [m["step"] for m in metrics(out)] == list(range(steps))  # every step once
    assert not list(out.glob("lease.*"))  # released on the way out
