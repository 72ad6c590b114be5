"""What the trainer's command line loads before it has work to do, in a fresh interpreter each: its
help and usage errors without torch (trainer.model.toy_spec), and quieting transformers without
loading it (trainer.__main__._quiet_libraries), so that the audit, which loads no model, never does."""

from run_helpers import fresh_python_prints


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
