"""The vLLM engine's parts that need vLLM installed, or a trainer process: the device it runs on, a run
asking for it where it is missing, a failed start. (Its output conversion, choices and errors without vLLM:
tests/test_vllm_engine.py, in the fast tier.)"""

import pytest
from vllm_required import require_vllm

from trainer import config as run_config
from trainer.rollout.vllm import vllm_device


def test_the_device_is_the_one_this_vllm_build_runs_on():
    import torch

    require_vllm()
    from vllm.platforms import current_platform

    expected = "cuda" if current_platform.is_cuda() else "cpu"
    assert vllm_device() == expected
    if not torch.cuda.is_available():
        assert expected == "cpu"  # the CPU build, as `make setup-vllm` installs it


def test_a_run_asking_for_vllm_where_it_is_missing_fails_before_training(toy_model, tmp_path):
    import os
    import subprocess
    import sys

    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "vllm.py").write_text("raise ImportError('vllm is shadowed by this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "trainer", "train", "--out", str(tmp_path / "run"),
                           f"model.path={toy_model}", "rollout.engine=vllm"], capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "rollout.engine: vllm is not installed" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_engine_that_fails_to_start_gives_the_process_its_environment_back(toy_model, tmp_path):
    """What the engine and vLLM set for a start (RANK, LOCAL_RANK, MASTER_PORT, LD_PRELOAD...) must not
    outlive a failed start: left behind, they made every later trainer and Snakemake child of the
    process a distributed rank (CI: one failed engine, then five study tests failed)."""
    require_vllm()
    import os

    from trainer.distributed import World, full_parameters
    from trainer.model.models import load_model, load_tokenizer
    from trainer.rollout.vllm import VLLMEngine

    model, tokenizer = load_model(str(toy_model)), load_tokenizer(str(toy_model))
    (tmp_path / "not-a-model").mkdir()
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    with pytest.raises(ValueError):  # vLLM's config validation: no config.json there
        VLLMEngine(str(tmp_path / "not-a-model"), model, tokenizer, run_config.RolloutConfig(), World(),
                   weights=lambda: full_parameters(model))
    assert {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} == before
