"""The vLLM engine's parts that run without vLLM: its output conversion, its choices and its errors.

The engine itself runs the contract suite (tests/test_rollout_contract.py) and trains
(tests/test_vllm_training.py) wherever vLLM is installed; what needs vLLM or a trainer process is in
tests/test_vllm_engine_start.py. The stand-ins below have exactly the
fields of vLLM 0.32's RequestOutput, CompletionOutput and Logprob that `to_rollouts` reads.
"""

import logging
from dataclasses import dataclass, field

import pytest

from trainer import config as run_config
from trainer.rollout.vllm import engine_environment, import_vllm, resolve_sleep, sleep_allocator_bytes, to_rollouts


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


def test_on_cuda_tritons_float32_products_are_ieee_unless_the_user_says_otherwise():
    """vLLM's Triton attention multiplies float32 inputs in TF32 by default: on an H100 its log-probs were
    3e-4 to 1.2e-3 nats from the trainer's (the engine contract allows float32 rounding, 6e-5 to 1.6e-4)."""
    config = run_config.load(None, ["model.path=x"]).rollout
    assert engine_environment(config, "cuda", {}) == {"TRITON_F32_DEFAULT": "ieee"}
    assert engine_environment(config, "cuda", {"TRITON_F32_DEFAULT": "tf32"}) == {}
    on_cpu = engine_environment(config, "cpu", {"OMP_NUM_THREADS": "3"})
    assert "TRITON_F32_DEFAULT" not in on_cpu and "OMP_NUM_THREADS" not in on_cpu
    assert on_cpu["VLLM_CPU_KVCACHE_SPACE"] == str(config.vllm_cpu_kvcache_gib)
    assert on_cpu["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.parametrize("asked,device,sleeps", [
    (True, "cuda", True), (False, "cuda", False), (True, "cpu", False), (False, "cpu", False)])
def test_sleep_mode_only_where_vllm_has_it(asked, device, sleeps):
    config = run_config.load(None, ["model.path=x", f"rollout.vllm_sleep={str(asked).lower()}"])
    assert resolve_sleep(config.rollout, device) is sleeps




def test_a_second_engine_in_a_process_sleeps_only_if_the_first_gave_its_memory_back(caplog):
    """vLLM's sleep-mode allocator serves one engine per process: on an H200 the contract's second engine
    (the untied model), started after the first was closed, failed with "CuMem allocator can only be
    used for one instance per process", and so would the second run of `train-runs`. Such an engine
    starts without sleep mode, and says why."""
    config = run_config.load(None, ["model.path=x", "rollout.vllm_sleep=true"])
    with caplog.at_level(logging.WARNING):
        assert resolve_sleep(config.rollout, "cuda", held_bytes=0) is True
        assert not caplog.records
        assert resolve_sleep(config.rollout, "cuda", held_bytes=3 * 2**29) is False
    assert "still holds 1.50 GiB in vLLM's sleep-mode allocator" in caplog.text
    assert "python -m trainer train" in caplog.text
    assert sleep_allocator_bytes() == 0  # no CUDA engine ever ran in this process
