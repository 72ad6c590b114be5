"""Run the trainer from tests: a toy run's overrides, its command line (one process or several under
accelerate launch), and what it writes."""

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

from trainer import lease
from trainer.launch import train_command

# A short run on the warm toy model: 4 prompts x 4 samples of up to 4 tokens per step.
TOY_RUN = {
    "task.options": "{max_operand: 9}",
    "rollout.max_new_tokens": 4,
    "rollout.stop": '["\\n"]',
    "objective.estimator": "k3",
    "objective.placement": "reward+loss",
    "objective.beta": 0.05,
    "train.steps": 20,
    "train.prompts_per_step": 4,
    "train.group_size": 4,
    "train.lr": "3e-4",
    "checkpoint.every": 5,
}


def overrides(model, base=TOY_RUN, **extra):
    """`key=value` arguments: the model, then `base`, then `extra` (dotted keys)."""
    return [f"{k}={v}" for k, v in {"model.path": str(model), **base, **extra}.items()]


def command(out, model, processes=1, base=TOY_RUN, **extra):
    return [*train_command(sys.executable, processes), "train", "--out", str(out), *overrides(model, base, **extra)]


def train_cli(out, model, processes=1, timeout=600, base=TOY_RUN, **extra):
    return subprocess.run(command(out, model, processes, base, **extra), capture_output=True, text=True,
                          timeout=timeout)


def trainer_in_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` called in this process (trainer.__main__.main, with no interpreter start
    and no imports to pay): its exit status, stdout and stderr as the command's would be. stderr holds
    what it logs at INFO and above, formatted as its own logging.basicConfig formats it, anything it
    prints there, and the traceback the interpreter would print for an exception it lets out (status 1).
    The logging level and transformers' verbosity (main quiets it) are restored afterwards."""
    from transformers.utils import logging as hf_logging

    from trainer.__main__ import main

    stdout, stderr = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level, verbosity, bars = root.level, hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    environ = dict(os.environ)  # main() sets transformers' quiet variables, which later processes would inherit
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as exit:  # argparse's usage errors
                code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
                if not isinstance(exit.code, int) and exit.code is not None:
                    print(exit.code, file=sys.stderr)
            except Exception:  # noqa: BLE001 - reported as the interpreter reports it
                traceback.print_exc()
                code = 1
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["python", "-m", "trainer", *args], code, stdout.getvalue(), stderr.getvalue())


def fresh_python_prints(code: str) -> list[str]:
    """The words `code` prints, run in a fresh interpreter: for what a process imports, which this one
    has long since done. A failing snippet fails the test with its stderr."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def start_cli(out, model, base=TOY_RUN, **extra):
    return subprocess.Popen(command(out, model, 1, base, **extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def kill_cli(process, out, timeout=60):
    """SIGKILL a run that `start_cli` started, and return once no trainer holds it, as a killed trainer
    started the ordinary way holds nothing once its parent has waited for it. Under the suite's warm start
    (tests/warm_start) the process is the job's client, and the worker that trains is killed a moment after
    it, when its reaper sees the client gone; a trainer started in that moment finds the run held."""
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while (holder := lease.current_holder(Path(out))) and lease.seems_alive(holder):
        assert time.monotonic() < deadline, f"the killed run's trainer, pid {holder['pid']}, still runs"
        time.sleep(0.05)


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def objective(out):
    """The run's objective.jsonl lines (the measured regularized objective)."""
    return [json.loads(line) for line in (Path(out) / "objective.jsonl").read_text().splitlines()]


def wait_for_lines(out, count, process, timeout=300):
    """Until the run in `out` has written `count` metrics lines (its process must not have ended)."""
    deadline = time.monotonic() + timeout
    path = Path(out) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"no {count} metrics lines within {timeout} s")


def default_sigint() -> None:
    """Popen's preexec_fn for a child that a test stops with Ctrl-C (SIGINT). A process started in
    the background of a non-interactive shell (`cmd &`, as a CI script may run the suite) inherits
    SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the child would not stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_trains_as_one_process(one: Path, many: Path, config_file: Path, model: Path) -> tuple[float, float]:
    """The run in `many` (several processes: tasks or nodes) logged what the run in `one` (one process, the same
    config file) did, step by step: each statistic equal to 1e-4, or both within the rounding of 0
    (rounding.statistic_rounding of `model`, the directory of the run's model). Returns (the largest loss gap,
    the rounding floor)."""
    import yaml
    from rounding import assert_same_statistic, statistic_rounding

    from trainer.model.models import load_model
    from trainer.run import TIMING_KEYS
    from trainer.run_files import read_metrics

    run_config = yaml.safe_load(config_file.read_text())
    floor = statistic_rounding(load_model(str(model)), {
        "train.prompts_per_step": run_config["train"]["prompts_per_step"],
        "train.group_size": run_config["train"]["group_size"],
        "rollout.max_new_tokens": run_config["rollout"]["max_new_tokens"]})
    a, b = ([{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in read_metrics(run / "metrics.jsonl")]
            for run in (one, many))
    assert [m["step"] for m in b] == [m["step"] for m in a] == list(range(run_config["train"]["steps"]))
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert_same_statistic(f"step {x['step']}: {key}", x[key], y[key], 1e-4, floor)
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)), floor
