"""What the trainer's command line loads before it has work to do, in a fresh interpreter each: its
help and usage errors without torch (trainer.model.toy_spec), and quieting transformers without
loading it (trainer.__main__._quiet_libraries), so that the audit, which loads no model, never does.
And how the command lines end: with what they made frozen (gc.freeze), so that the interpreter's last
collections skip it (about 1 s of CPU at the end of a trainer process, an evaluation or a study
report, 0.3 s of a Snakemake dry run)."""

import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import fresh_python_prints

REPO = Path(__file__).resolve().parent.parent


def test_help_and_usage_errors_answer_without_loading_torch():
    assert fresh_python_prints("""
        import contextlib, io, sys
        from trainer.__main__ import main
        for argv in (["--help"], ["toy-model", "--no-such-option"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    main(argv)
                except SystemExit:  # argparse's way out of both
                    pass
        print("torch" in sys.modules)
    """) == ["False"]


def test_quieting_transformers_does_not_load_it_and_keeps_a_users_verbosity():
    assert fresh_python_prints("""
        import os, sys
        os.environ["TRANSFORMERS_VERBOSITY"] = "info"
        from trainer.__main__ import _quiet_libraries
        _quiet_libraries()
        loaded = "transformers" in sys.modules
        from transformers.utils import logging
        print(loaded, os.environ["TRANSFORMERS_VERBOSITY"], os.environ["HF_HUB_DISABLE_PROGRESS_BARS"],
              logging.get_verbosity() == logging.INFO, logging.is_progress_bar_enabled())
    """) == ["False", "info", "1", "True", "False"]


# A command of each package's command line that fails at once, through its main's own error path.
FAILING = {"trainer": ["train", "--out", "{tmp}/run", "model.path={tmp}/no-model"],
           "eval": ["run", "--model", "{tmp}/no-model", "--suite", "toy", "--out", "{tmp}/eval"],
           "sweep": ["status", "--configfile", "{tmp}/no-study.yaml"]}


def frozen_at_exit(tmp_path, argv: list[str], start: str) -> tuple[int, str]:
    """The exit status of `start` (Python statements) run with sys.argv = argv, and whether anything was frozen
    when the interpreter ran its exit handlers."""
    code = (f"import atexit, gc, sys\natexit.register(lambda: print('frozen:', gc.get_freeze_count() > 0))\n"
            f"sys.argv = {argv!r}\n{start}\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("module", FAILING)
def test_each_command_line_ends_with_what_it_made_frozen(module, tmp_path):
    argv = [module, *(arg.format(tmp=tmp_path) for arg in FAILING[module])]
    status, output = frozen_at_exit(tmp_path, argv, f"import runpy; runpy.run_module({module!r}, run_name='__main__')")
    assert status == 2 and "frozen: True" in output, output


def test_a_snakemake_of_the_study_ends_with_what_it_made_frozen(tmp_path):
    argv = ["snakemake", "--snakefile", str(REPO / "Snakefile"), "--configfile",
            str(REPO / "workflow" / "config" / "toy_quick.yaml"), "-n", "--quiet", "rules"]
    status, output = frozen_at_exit(tmp_path, argv, "from snakemake.cli import main; main()")
    assert status == 0 and "frozen: True" in output, output
