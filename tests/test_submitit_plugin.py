"""The submitit executor plugin's own parts, without a cluster: resources as sbatch parameters, a job's command
stopped gently and requeued, its settings in Snakemake's help. (Against a real SLURM cluster: tests/test_slurm.py.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from test_slurm import SNAKEMAKE

from snakemake_executor_plugin_submitit.executor import parse_sbatch
from snakemake_executor_plugin_submitit.resources import signature, slurm_parameters


def test_resources_map_to_sbatch_parameters():
    params = slurm_parameters({"gpu": 2, "mem_mb": 64000, "runtime": 240, "slurm_partition": "gpu", "nodes": 1,
                               "tasks": 1, "constraint": "a100", "slurm_account": "lab"}, 8,
                              {"partition": "cpu", "account": None, "qos": "normal"})
    assert params == {"partition": "gpu", "qos": "normal", "cpus_per_task": 8, "gpus_per_node": 2, "mem": "64000M",
                      "time": 240, "nodes": 1, "ntasks_per_node": 1, "constraint": "a100", "account": "lab"}
    assert slurm_parameters({"gpus": 1}, 1, {})["gpus_per_node"] == 1
    assert "gpus_per_node" not in slurm_parameters({"gpu": 0}, 1, {})
    assert signature(slurm_parameters({"mem_mb": 10}, 1, {})) != signature(slurm_parameters({"mem_mb": 20}, 1, {}))
    assert parse_sbatch("exclusive=, mail-type=END") == {"exclusive": "", "mail_type": "END"}


def test_checkpoint_stops_the_command_gently_then_hands_back_the_same_command(tmp_path):
    """What a job does when SLURM warns of its time limit: SIGTERM to the command's whole process group
    (here a shell that saves its state on SIGTERM, and a grandchild), wait for it, requeue the same command."""
    import threading

    from snakemake_executor_plugin_submitit.command import JobCommand, JobFailed

    saved, pid_file = tmp_path / "saved", tmp_path / "grandchild"
    command = JobCommand(f"trap 'echo step > {saved}; exit 75' TERM; sleep 60 & echo $! > {pid_file}; wait",
                         grace_s=20)
    outcome = {}

    def call():
        try:
            command()
        except JobFailed as error:
            outcome["error"] = str(error)

    thread = threading.Thread(target=call)
    thread.start()
    while not pid_file.exists() or not pid_file.read_text().strip():
        time.sleep(0.05)  # the shell has set its trap and started the grandchild
    grandchild = int(pid_file.read_text())
    requeued = command.checkpoint()
    thread.join(timeout=60)
    assert not thread.is_alive()
    # the trap's own exit status: the shell saved its state on SIGTERM, it was not killed at the deadline
    assert saved.read_text() == "step\n" and outcome["error"] == "the job's command exited with status 75"
    status = Path(f"/proc/{grandchild}/status")
    for _ in range(200):  # the grandchild got SIGTERM too (it is in the group): gone, or a zombie nobody reaps
        if not status.exists() or "\nState:\tZ" in status.read_text():
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the command's grandchild {grandchild} outlived the checkpoint")
    assert requeued.function.command == command.command and requeued.function is not command


def test_plugin_settings_appear_in_snakemake_help(tmp_path):
    result = subprocess.run([*SNAKEMAKE, "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for option in ("--submitit-folder", "--submitit-partition", "--submitit-account", "--submitit-qos",
                   "--submitit-array-parallelism", "--submitit-max-timeouts", "--submitit-signal-delay",
                   "--submitit-sbatch"):
        assert option in result.stdout, option
    assert "SNAKEMAKE_SUBMITIT_PARTITION" in result.stdout and "SNAKEMAKE_SUBMITIT_ACCOUNT" in result.stdout


def test_a_run_of_sacct_failures_is_said_once_a_minute_and_its_end_too():
    """submitit logs sacct's failures at its own logger and keeps the old job states; the executor's watch
    turns three failed updates in a row into one message naming the cause, again at most once a minute,
    and says when sacct answers again."""
    import logging

    from snakemake_executor_plugin_submitit.sacct_watch import SacctWatch

    watch = SacctWatch.attach()
    submitit_logger = logging.getLogger("submitit")
    try:
        def update(now: float, fails: bool):
            if fails:  # what submitit logs when its sacct call fails
                submitit_logger.warning("Call #7 - Bypassing sacct error Command '['sacct']' returned non-zero "
                                        "exit status 1., status may be inaccurate.")
            return watch.after_update(now, jobs=2)

        assert [update(t, True) for t in (0, 1)] == [None, None]
        level, message = update(2, True)
        assert level == "error" and "failed 3 times in a row" in message and "slurmdbd" in message
        assert "Bypassing sacct error" in message and "the 2 jobs followed" in message
        assert update(30, True) is None and update(61, True) is None  # within a minute of the message
        assert update(63, True)[1].startswith("sacct has failed 6 times")
        assert update(64, False) == ("info", "sacct answers again: the jobs' states are read anew")
        assert update(65, False) is None and update(66, True) is None  # a single failure says nothing
    finally:
        submitit_logger.removeHandler(watch)
