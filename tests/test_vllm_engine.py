"""The vLLM engine's parts that run without vLLM: its output conversion, its choices and its errors.

The engine itself runs the contract suite (tests/test_rollout_contract.py) and trains
(tests/test_vllm_training.py) wherever vLLM is installed. The stand-ins below have exactly the
fields of vLLM 0.32's RequestOutput, CompletionOutput and Logprob that `to_rollouts` reads.
"""

from dataclasses import dataclass, field

import pytest
from vllm_required import require_vllm

from trainer import config as run_config
from trainer.rollout.vllm import import_vllm, resolve_sleep, to_rollouts, vllm_device


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput] = field(default_factory=list)


def _completion(index, tokens, reason="stop", text="x"):
    logprobs = [{t: Logprob(-0.1 * (i + 1), rank=1), 999: Logprob(-9.0)} for i, t in enumerate(tokens)]
    return CompletionOutput(index, text, tokens, None, logprobs, reason)


def test_outputs_become_rollouts_in_prompt_and_index_order():
    outputs = [RequestOutput([_completion(1, [7, 8], "length", "b"), _completion(0, [5], "stop", "a")]),
               RequestOutput([_completion(0, [], "stop", ""), _completion(1, [4, 4, 2], "stop", "c")])]
    r = to_rollouts(outputs, [[1, 2], [3]], n=2)
    assert r.prompt_ids == [[1, 2], [3]] and r.n == 2
    assert r.token_ids == [[5], [7, 8], [], [4, 4, 2]]
    assert r.texts == ["a", "b", "", "c"] and r.finish_reasons == ["stop", "length", "stop", "stop"]
    assert r.logprobs[1] == pytest.approx([-0.1, -0.2])  # the sampled token's, not another candidate's
    assert r.logprobs[3] == pytest.approx([-0.1, -0.2, -0.3])


@pytest.mark.parametrize("outputs,message", [
    ([RequestOutput([_completion(0, [5])])], "1 completions of a prompt, 2 were asked for"),
    ([RequestOutput([_completion(0, [5]), _completion(1, [6], "abort")])], "ended a completion with 'abort'"),
    ([RequestOutput([_completion(0, [5]), CompletionOutput(1, "", [6], None, None, "stop")])], "no log-prob"),
])
def test_bad_outputs_are_named(outputs, message):
    with pytest.raises(RuntimeError, match=message):
        to_rollouts(outputs, [[1]], n=2)


def test_a_missing_vllm_is_one_clear_error_naming_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees where it is not installed
    with pytest.raises(run_config.ConfigError, match=r"vllm is not installed .*make setup-vllm.*\.\[gpu\]"):
        import_vllm()


@pytest.mark.parametrize("asked,device,sleeps", [
    (True, "cuda", True), (False, "cuda", False), (True, "cpu", False), (False, "cpu", False)])
def test_sleep_mode_only_where_vllm_has_it(asked, device, sleeps):
    config = run_config.load(None, ["model.path=x", f"rollout.vllm_sleep={str(asked).lower()}"])
    assert resolve_sleep(config.rollout, device) is sleeps


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
