"""The hf engine's own contract, beyond the one every engine passes (test_rollout_contract.py): it samples
on the model's device, reads back no [B, V] tensor and at most one thing per decoding step, draws on
the CPU exactly what it drew when it sampled on the host, and compiles its decoding once per process,
falling back to eager decoding when compiling fails."""

import functools
import logging
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from trainer import config as run_config
from trainer.batch import pack
from trainer.model.logprobs import completion_logprobs
from trainer.model.models import load_model, load_tokenizer
from trainer.rollout import decoding
from trainer.rollout.base import SamplingParams, sample_seeds
from trainer.rollout.hf import HFEngine
from trainer.rollout.sampling import sampling_logprobs

TEXTS = ["12+7=", "3-1=", "a much longer prompt: 100+250="]  # different lengths: padding matters


@pytest.fixture(scope="module")
def toy(toy_model):
    tokenizer = load_tokenizer(str(toy_model))
    return load_model(str(toy_model)), tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def _sampled_on_the_host(model, tokenizer, prompts, params: SamplingParams, seeds):
    """The engine's sampling before it moved to the device, as the reference: the model's own cache, the
    [B, V] log-probs copied to the host every step, torch.multinomial with a CPU generator per prompt."""
    pad, eos, n = tokenizer.pad_token_id, tokenizer.eos_token_id, params.n
    rows = [p for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    window = max((len(s) for s in params.stop), default=0)
    tokens, logprobs, finish = [[] for _ in rows], [[] for _ in rows], ["length"] * len(rows)
    going = [True] * len(rows)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1)
        position = position[:, -1:]
        for _ in range(params.max_new_tokens):
            logp = sampling_logprobs(out.logits[:, -1], params.temperature, params.top_p).cpu()
            drawn = torch.cat([torch.multinomial(logp[i * n:(i + 1) * n].exp(), 1, generator=g)
                               for i, g in enumerate(generators)]).squeeze(-1).tolist()
            for i, token in enumerate(drawn):
                if going[i]:
                    tokens[i].append(token)
                    logprobs[i].append(float(logp[i, token]))
                    tail = tokenizer.decode(tokens[i][-window:], skip_special_tokens=True) if window else ""
                    if token == eos or any(s in tail for s in params.stop):
                        going[i], finish[i] = False, "stop"
            if not any(going):
                break
            step = torch.tensor([t if g else pad for t, g in zip(drawn, going, strict=True)]).unsqueeze(-1)
            mask = torch.cat([mask, torch.tensor(going).long().unsqueeze(-1)], dim=-1)
            position = position + 1
            out = model(input_ids=step, attention_mask=mask, position_ids=position,
                        past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    return tokens, logprobs, finish


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, max_new_tokens=12),
    SamplingParams(n=2, max_new_tokens=12, temperature=0.7, top_p=0.7),
    SamplingParams(n=4, max_new_tokens=20, top_p=0.3, stop=("1", "+")),
], ids=["plain", "temperature-top-p", "top-p-stop-strings"])
def test_on_the_cpu_it_draws_bit_for_bit_what_sampling_on_the_host_drew(toy, params):
    model, tokenizer, prompts = toy
    engine = HFEngine(model, tokenizer)
    for seed in range(4):
        seeds = sample_seeds(seed, 0, len(prompts))
        r = engine.generate(prompts, params, seeds)
        assert (r.token_ids, r.logprobs, r.finish_reasons) == _sampled_on_the_host(model, tokenizer, prompts, params,
                                                                                   seeds)


class _HostReads(TorchFunctionMode):
    """Every read of a tensor back to the host made by the engine's own code (not by the model's forward),
    in order among the model's forward passes."""

    READS = {"cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__"}

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        to_host = name == "to" and "cpu" in str(args[1:]) + str(kwargs)
        if (name in self.READS or to_host) and args and isinstance(args[0], torch.Tensor):
            if "trainer/rollout" in sys._getframe(1).f_code.co_filename.replace("\\", "/"):
                self.events.append((name, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stop", [(), ("7",)])
def test_a_decoding_step_reads_one_small_thing_back_and_never_the_vocabulary(toy, stop):
    model, tokenizer, prompts = toy
    engine = HFEngine(model, tokenizer)
    reads = _HostReads()
    hook = model.register_forward_pre_hook(lambda module, args: reads.events.append(("forward", ())))
    try:
        with reads:
            r = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=24, stop=stop), [1, 2, 3])
    finally:
        hook.remove()
    vocabulary = model.config.vocab_size
    assert [e for e in reads.events if len(e[1]) > 1 and e[1][-1] == vocabulary] == []
    forwards = [i for i, (name, _) in enumerate(reads.events) if name == "forward"]
    assert len(forwards) == max(map(len, r.token_ids))  # the prompts' pass, then one per token but the last
    between = [reads.events[a + 1:b] for a, b in zip(forwards, forwards[1:], strict=False)]
    assert all(len(step) == 1 for step in between), between


class _Concatenations(TorchFunctionMode):
    """The shapes of the 4-D tensors that torch.cat joined along their third dimension (key and value
    states are [B, heads, T, d])."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        dim = (kwargs or {}).get("dim", args[1] if len(args) > 1 else 0)
        if func is torch.cat and dim in (2, -2):
            self.shapes += [tuple(t.shape) for t in args[0] if t.dim() == 4]
        return func(*args, **(kwargs or {}))


def test_the_kv_cache_is_written_in_place_not_copied_at_every_token(toy):
    model, tokenizer, prompts = toy
    engine = HFEngine(model, tokenizer)
    with _Concatenations() as concatenations:
        engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12), [1, 2, 3])
    assert concatenations.shapes == []


def test_a_model_on_more_than_one_device_is_refused(toy_model):
    model, tokenizer = load_model(str(toy_model)), load_tokenizer(str(toy_model))
    model.model.norm.to("meta")
    with pytest.raises(ValueError, match="the model's parameters are on cpu and meta; it samples on the model's dev"):
        HFEngine(model, tokenizer)


@pytest.fixture
def dynamo(monkeypatch):
    """Compiled decoding through torch.compile with a backend that runs the captured graph as it is
    (tracing, guards and the static cache are real; seconds instead of inductor's minute); the list of
    graphs it was given."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = functools.cache(lambda mode: torch.compile(decoding._one_token, backend=backend, fullgraph=True,
                                                          dynamic=False))
    monkeypatch.setattr(decoding, "compiled_one_token", compiled)
    monkeypatch.setattr(decoding, "_failures", [])
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


def test_compiled_decoding_samples_the_trainers_distribution_and_compiles_once_per_process(toy_model, toy, dynamo):
    _, tokenizer, prompts = toy
    params = SamplingParams(n=2, max_new_tokens=8, top_p=0.9)
    for _ in range(2):  # two runs in one process (train-runs): each its own model and engine
        model = load_model(str(toy_model))
        engine = HFEngine(model, tokenizer, decoding="compiled")
        for seed in range(2):
            r = engine.generate(prompts, params, sample_seeds(seed, 0, len(prompts)))
            assert r.to_state() == engine.generate(prompts, params, sample_seeds(seed, 0, len(prompts))).to_state()
            batch = pack(r, tokenizer.pad_token_id)
            with torch.no_grad():
                full, _ = completion_logprobs(model, batch)
            mask = batch.completion_mask.bool()
            assert (batch.behaviour_logp[mask] >= full[mask] - 1e-5).all()  # the nucleus, renormalised
        assert engine.decoder.compiled
    assert len(dynamo) == 1


def test_compiled_decoding_survives_the_input_grad_hook_of_gradient_checkpointing(toy_model, toy, dynamo, caplog):
    """transformers 5.17 turns gradient checkpointing on with a forward hook on the input embeddings that
    calls requires_grad_ on their output; torch 2.11's compiler cannot trace it, and on an H100 every SmolLM2
    run of the GPU study fell back to eager decoding. The engine decodes without the hook and puts it back."""
    _, tokenizer, prompts = toy
    model = load_model(str(toy_model))
    model.enable_input_require_grads()  # what gradient_checkpointing_enable does in transformers 5.17
    engine = HFEngine(model, tokenizer, decoding="compiled")
    with caplog.at_level(logging.WARNING):
        engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4), sample_seeds(0, 0, len(prompts)))
    assert engine.decoder.compiled and len(dynamo) == 1
    assert "requires_grad" not in dynamo[0].code  # torch 2.13 traces the hook; 2.11 gave up on it
    assert not [r for r in caplog.records if "compiled decoding failed" in r.getMessage()]
    assert model._require_grads_hooks  # back for the update's forward
    embedded = model.get_input_embeddings()(torch.tensor([prompts[0]]))
    assert embedded.requires_grad


def test_a_compilation_that_fails_falls_back_to_eager_decoding_with_one_warning(toy_model, toy, monkeypatch, caplog):
    model, tokenizer, prompts = toy

    def no_compiler(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")

    compiled = functools.cache(lambda mode: torch.compile(decoding._one_token, backend=no_compiler, fullgraph=True))
    monkeypatch.setattr(decoding, "compiled_one_token", compiled)
    monkeypatch.setattr(decoding, "_failures", [])
    torch._dynamo.reset()
    params, seeds = SamplingParams(n=3, max_new_tokens=10), [5, 6, 7]
    eager = HFEngine(model, tokenizer, decoding="eager").generate(prompts, params, seeds)
    with caplog.at_level(logging.INFO, logger="trainer.rollout.decoding"):
        engine = HFEngine(model, tokenizer, decoding="compiled")
        assert engine.generate(prompts, params, seeds).to_state() == eager.to_state()
        later = HFEngine(load_model(str(toy_model)), tokenizer, decoding="compiled")  # the next run of the process
        assert later.generate(prompts, params, seeds).to_state() == eager.to_state()
    torch._dynamo.reset()
    assert not engine.decoder.compiled and not later.decoder.compiled
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["hf engine: compiled decoding failed (RuntimeError: no C++ compiler here); "
                        "decoding eagerly from now on"]
    assert "compiling failed earlier: RuntimeError: no C++ compiler here" in caplog.records[-1].getMessage()


def test_how_it_decodes_is_said_once_per_engine():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    llama = type("LlamaForCausalLM", (), {"_can_compile_fullgraph": True})()
    assert decoding.wants_compiled("auto", llama, cpu) == (
        False, "hf engine: eager decoding on cpu (rollout.hf_decoding auto compiles on CUDA only)")
    assert decoding.wants_compiled("auto", llama, cuda)[0]
    assert decoding.wants_compiled("compiled", object(), cuda) == (
        False, "hf engine: eager decoding on cuda (object cannot compile with a static KV cache)")
    assert [decoding.static_length(n) for n in (1, 64, 65, 300)] == [64, 64, 128, 512]
    with pytest.raises(run_config.ConfigError, match="rollout.hf_decoding: 'fast' is not one of auto, eager, compiled"):
        run_config.load(None, ["model.path=m", "rollout.hf_decoding=fast"])


def test_compiled_decoding_holds_under_bf16_mixed_precision(toy_model, toy, dynamo, caplog):
    """Under bf16 autocast (train.mixed_precision bf16: the engine samples in bf16 as the trainer computes)
    a Llama's keys leave the rotary embedding in float32 and its values in bfloat16. transformers' static
    cache holds both in the keys' dtype, and the first write of the values failed ("index_copy_(): self
    and source expected to have the same dtype"): on an H200 every bf16 run fell back to eager decoding
    at half the speed. Eager and compiled decoding now sample alike."""
    _, tokenizer, prompts = toy
    model = load_model(str(toy_model))
    params, seeds = SamplingParams(n=2, max_new_tokens=6), sample_seeds(0, 0, len(prompts))
    with caplog.at_level(logging.WARNING), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = HFEngine(model, tokenizer, decoding="compiled").generate(prompts, params, seeds)
        eager = HFEngine(model, tokenizer, decoding="eager").generate(prompts, params, seeds)
    assert not [r for r in caplog.records if "compiled decoding failed" in r.getMessage()]
    assert len(dynamo) == 1
    assert compiled.token_ids == eager.token_ids
    gap = max(abs(a - b) for row_a, row_b in zip(compiled.logprobs, eager.logprobs, strict=True)
              for a, b in zip(row_a, row_b, strict=True))
    assert gap < 0.05, gap  # bf16 rounding of two attention lengths (the static cache's, the filled part)
