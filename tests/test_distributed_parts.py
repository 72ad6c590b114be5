"""What micro-batches and several processes rest on, checked without training: micro-batches hold whole
groups, statistics combine over shares, the launch command. (The updates themselves, compared:
tests/test_distributed.py.)"""

import signal
import subprocess
import sys

import pytest
from test_distributed import _overrides

from trainer import config as run_config
from trainer.launch import train_command
from trainer.objective.loss import combine_stats
from trainer.run import EXIT_PREEMPTED, Run


def test_micro_batches_must_hold_whole_groups(warm_model, tmp_path):
    with pytest.raises(run_config.ConfigError, match="train.micro_batch_size: 6 is not a multiple of group_size 4"):
        run_config.load(None, _overrides(warm_model, **{"train.micro_batch_size": 6}))
    config = run_config.load(None, _overrides(warm_model, **{"train.micro_batch_size": 12}))
    with pytest.raises(run_config.ConfigError, match="does not divide the 16 completions"):
        Run(config, tmp_path / "bad")


def test_combined_statistics_add_shares_and_keep_extremes():
    parts = [{"loss": 0.25, "ratio_min": 0.9, "ratio_max": 1.1, "kl_k3": 1.0},
             {"loss": 0.5, "ratio_min": 0.8, "ratio_max": 1.3, "kl_k3": 3.0}]
    assert combine_stats(parts) == {"loss": 0.75, "ratio_min": 0.8, "ratio_max": 1.3, "kl_k3": 2.0}


def test_the_launch_command():
    assert train_command("py", 1) == ["py", "-m", "trainer"]
    launch = train_command("py", 4)
    assert launch[2:5] == ["py", "-m", "accelerate.commands.launch"] and launch[-2:] == ["-m", "trainer"]
    assert launch[launch.index("--num_processes") + 1] == "4"


@pytest.mark.parametrize("status", [EXIT_PREEMPTED, 1])
def test_a_preempted_trainer_ignores_a_later_sigterm_as_it_exits(status):
    """In a SLURM step of two tasks, the first to exit 75 makes srun terminate the other, which may still be
    tearing down after its checkpoint: it must still exit 75 (CI saw it die by SIGTERM, 143, and the job end
    FAILED). Here the SIGTERM comes from the interpreter's own exit; any other status keeps the default."""
    code = ("import atexit, os, signal; from trainer.exit_status import exit_with; "
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM)); "
            f"exit_with({status})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == (EXIT_PREEMPTED if status == EXIT_PREEMPTED else -signal.SIGTERM), done.stderr


@pytest.mark.parametrize("raised,status", [("KeyboardInterrupt", 130), ("RuntimeError('boom')", 1)])
def test_an_interrupted_or_failed_trainer_whose_shutdown_hangs_still_ends(raised, status):
    """Ctrl-C that lands as transformers starts its first model-loading thread leaves that thread (not a
    daemon) waiting for work for ever, and the interpreter's exit waits for it: under Snakemake, CI's
    Ctrl-C never returned. A command that fails or is interrupted ends within the limit all the same."""
    def ending(thread: str, limit_s: int) -> subprocess.CompletedProcess:
        code = ("import signal, threading; from trainer.exit_status import run_and_exit\n"
                "signal.signal(signal.SIGALRM, lambda *_: None)\n"  # as math-verify's timeouts have one
                f"{thread}\n"
                f"def main():\n    raise {raised}\n"
                f"run_and_exit(main, limit_s={limit_s})")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert ("interrupted (SIGINT)" if status == 130 else "RuntimeError: boom") in done.stderr
        return done

    hung = ending("threading.Thread(target=threading.Event().wait).start()", limit_s=1)
    assert hung.returncode == -signal.SIGALRM, hung.stderr
    ended = ending("pass", limit_s=60)
    assert ended.returncode == status, ended.stderr


def test_a_preempted_trainer_whose_shutdown_hangs_still_ends():
    """SIGTERM no longer stops a trainer that exits 75, so a shutdown that never ends (here an exit handler
    that waits forever) is ended by the alarm that exit_with sets, not left for the launcher's SIGKILL."""
    code = ("import atexit, threading; from trainer.exit_status import exit_with; "
            "atexit.register(threading.Event().wait); exit_with(75, limit_s=1)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGALRM, done.stderr
