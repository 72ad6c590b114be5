"""What the trainer's command line loads before it has work to do, in a fresh interpreter each: its
help and usage errors without torch (trainer.model.toy_spec), and quieting transformers without
loading it (trainer.__main__._quiet_libraries), so that the audit, which loads no model, never does."""

import subprocess
import sys
import textwrap


def _run(code: str) -> list[str]:
    """The words of the last line the code prints (the help goes to stdout before it)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    return done.stdout.splitlines()[-1].split() if done.stdout else [done.stderr[-2000:]]


def test_help_and_usage_errors_answer_without_loading_torch():
    assert _run("""
        import sys
        from trainer.__main__ import main
        for argv in (["--help"], ["toy-model", "--no-such-option"]):
            try:
                main(argv)
            except SystemExit as exit:
                print(exit.code, file=sys.stderr)
        print("torch" in sys.modules)
    """) == ["False"]


def test_quieting_transformers_does_not_load_it_and_keeps_a_users_verbosity():
    assert _run("""
        import os, sys
        os.environ["TRANSFORMERS_VERBOSITY"] = "info"
        from trainer.__main__ import _quiet_libraries
        _quiet_libraries()
        loaded = "transformers" in sys.modules
        from transformers.utils import logging
        print(loaded, os.environ["TRANSFORMERS_VERBOSITY"], os.environ["HF_HUB_DISABLE_PROGRESS_BARS"],
              logging.get_verbosity() == logging.INFO, logging.is_progress_bar_enabled())
    """) == ["False", "info", "1", "True", "False"]
