"""The contract every rollout engine must pass: hf (the trainer's own model, and a replica synced from
it), and vLLM on a model with tied and with untied embeddings (its CPU build here, after
`make setup-vllm`; CI requires it)."""

import contextlib
import math
import os

import pytest
import torch
from rounding import logprob_rounding
from vllm_required import require_vllm

from trainer.batch import Rollouts, pack
from trainer.model.logprobs import completion_logprobs
from trainer.model.models import load_model, load_tokenizer
from trainer.rollout.base import SamplingParams, sample_seeds


def _hf(model, tokenizer, model_dir):
    from trainer.rollout.hf import HFEngine

    return HFEngine(model, tokenizer)  # as one training process has it: the trainer's own model


def _hf_replica(model, tokenizer, model_dir):
    import copy

    from trainer.distributed import full_parameters
    from trainer.rollout.hf import HFEngine

    # as a sharded trainer has it: a copy of its own, refreshed from the trainer's weights on sync
    return HFEngine(copy.deepcopy(model), tokenizer, weights=lambda: full_parameters(model))


def _vllm(model, tokenizer, model_dir):
    require_vllm()
    from trainer import config as run_config
    from trainer.distributed import World, full_parameters
    from trainer.rollout import make_engine

    config = run_config.load(None, [f"model.path={model_dir}", "rollout.engine=vllm",
                                    "rollout.vllm_gpu_memory_utilization=0.2"])
    return make_engine(config, model, tokenizer, World(), weights=lambda: full_parameters(model))


ENGINES = {"hf": _hf, "hf-replica": _hf_replica, "vllm": _vllm, "vllm-untied": _vllm}


@pytest.fixture(scope="module", params=list(ENGINES))
def setup(request):
    """An engine over the toy model (tied embeddings; `-untied`: an output layer of its own)."""
    model_dir = request.getfixturevalue("untied_toy_model" if request.param.endswith("-untied") else "toy_model")
    tokenizer = load_tokenizer(str(model_dir))
    model = load_model(str(model_dir))
    if request.param.startswith("vllm"):
        require_vllm()  # what `import vllm` sets in the environment, it sets for the process, on purpose
    environ = _environ()
    engine = ENGINES[request.param](model, tokenizer, model_dir)
    texts = ["12+7=", "3-1=", "a much longer prompt: 100+250="]  # different lengths: padding matters
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    yield engine, model, tokenizer, prompts
    engine.close()
    # the process gets its environment back: a vLLM engine's MASTER_PORT, left behind, made every later
    # lm-eval run in a child process rendezvous on that port (two at once failed with EADDRINUSE)
    assert _environ() == environ


def _environ():
    return {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}


def _generate(setup, seed=0, **params):
    engine, _, _, prompts = setup
    return engine.generate(prompts, SamplingParams(**params), sample_seeds(seed, 0, len(prompts)))


def test_n_completions_per_prompt_in_consecutive_rows(setup):
    _, _, _, prompts = setup
    r = _generate(setup, n=4, max_new_tokens=6)
    assert len(r) == 12 and r.n == 4 and r.prompt_ids == prompts
    for tokens, logprobs, reason in zip(r.token_ids, r.logprobs, r.finish_reasons, strict=True):
        assert len(tokens) == len(logprobs) >= 1
        assert all(math.isfinite(x) and x <= 0 for x in logprobs)
        assert reason in ("stop", "length")
        assert reason == "stop" or len(tokens) == 6


def test_behaviour_logprobs_are_the_trainers_at_temperature_one(setup):
    _, model, tokenizer, _ = setup
    r = _generate(setup, n=3, max_new_tokens=8)
    batch = pack(r, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_logp, _ = completion_logprobs(model, batch)
    diff = ((trainer_logp - batch.behaviour_logp) * batch.completion_mask).abs().max()
    assert diff <= logprob_rounding(model)


def test_behaviour_logprobs_follow_temperature_and_top_p(setup):
    _, model, tokenizer, _ = setup
    hot = _generate(setup, n=2, max_new_tokens=8, temperature=0.7)
    batch = pack(hot, tokenizer.pad_token_id)
    with torch.no_grad():
        at_temperature, _ = completion_logprobs(model, batch, temperature=0.7)
    assert ((at_temperature - batch.behaviour_logp) * batch.completion_mask).abs().max() <= logprob_rounding(model)
    nucleus = _generate(setup, n=2, max_new_tokens=8, top_p=0.3)
    batch = pack(nucleus, tokenizer.pad_token_id)
    with torch.no_grad():
        full, _ = completion_logprobs(model, batch)
    mask = batch.completion_mask.bool()
    # sampled from the renormalised nucleus: every kept token is at least as likely there
    assert (batch.behaviour_logp[mask] >= full[mask] - logprob_rounding(model)).all()
    assert (batch.behaviour_logp[mask] > full[mask] + 1e-3).any()


def test_stop_strings_end_completions_and_are_cut_from_the_text(setup):
    _, _, tokenizer, _ = setup
    r = _generate(setup, n=12, max_new_tokens=40, stop=("a", "e"))
    stopped = 0
    for tokens, text, reason in zip(r.token_ids, r.texts, r.finish_reasons, strict=True):
        raw = tokenizer.decode(tokens, skip_special_tokens=True)
        assert "a" not in text and "e" not in text
        assert raw.startswith(text)
        if reason == "stop" and tokens[-1] != tokenizer.eos_token_id:
            assert raw.endswith(("a", "e"))  # it stopped on the token that completed a stop string
            stopped += 1
        elif reason == "length":
            assert len(tokens) == 40 and text == raw
    assert stopped > 0


@contextlib.contextmanager
def _trained_to(setup, model_dir):
    """The trainer's model takes the weights in `model_dir` and the engine is told to sync, as after
    a training step; afterwards both go back."""
    engine, model, _, _ = setup
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    new = dict(load_model(str(model_dir)).named_parameters(remove_duplicate=False))  # lm_head: the tied one
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name])
    engine.sync_weights()
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(before[name])
        engine.sync_weights()


def test_eos_is_kept_in_the_tokens_and_dropped_from_the_text_after_a_weight_sync(setup, warm_model):
    """The warm model ends its answers with EOS; the engine samples from it only if it synced."""
    engine, model, tokenizer, _ = setup
    prompt = tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    with _trained_to(setup, warm_model):
        r = engine.generate([prompt], SamplingParams(n=8, max_new_tokens=6), [0])
        batch = pack(r, tokenizer.pad_token_id)
        with torch.no_grad():
            trainer_logp, _ = completion_logprobs(model, batch)
        assert ((trainer_logp - batch.behaviour_logp) * batch.completion_mask).abs().max() <= logprob_rounding(model)
    ended = [t for t, reason in zip(r.token_ids, r.finish_reasons, strict=True) if reason == "stop"]
    assert ended and all(t[-1] == tokenizer.eos_token_id for t in ended)
    assert all(tokenizer.eos_token not in text for text in r.texts)


def _next_token_distribution(model, prompt, temperature, top_p):
    """What the engine must sample the first token from, computed here from the trainer's logits: the
    softmax at `temperature`, cut to the smallest set of most likely tokens holding `top_p`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order[mass_before < top_p]] = True
    return torch.where(kept, probs, 0.0) / probs[kept].sum()


def _chi_square_p_value(counts, expected):
    """Pearson's test of counts against expected counts; classes expected fewer than 5 times are pooled."""
    rare = expected < 5
    observed = torch.cat([counts[~rare], counts[rare].sum().reshape(1)])
    wanted = torch.cat([expected[~rare], expected[rare].sum().reshape(1)])
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    statistic = ((observed - wanted) ** 2 / wanted).sum()
    dof = torch.tensor(len(wanted) - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.7)])
def test_samples_follow_the_trainers_distribution(setup, warm_model, temperature, top_p):
    """The tokens themselves, not only their reported log-probs: 4000 first tokens from the warm
    model against the distribution the trainer's logits give at this temperature and top-p (a
    chi-square test at p = 1e-4; the seeds are fixed, so the test is deterministic). Sampling at the
    wrong temperature, or ignoring top-p, fails it."""
    engine, model, _, prompts = setup
    prompt, samples = prompts[0], 4000  # "12+7=": the warm model hesitates between three first tokens
    with _trained_to(setup, warm_model):
        wanted = _next_token_distribution(model, prompt, temperature, top_p)
        r = engine.generate([prompt], SamplingParams(n=samples, max_new_tokens=1, temperature=temperature,
                                                     top_p=top_p), [7])
    first = torch.tensor([tokens[0] for tokens in r.token_ids])
    counts = torch.bincount(first, minlength=len(wanted)).double()
    assert counts[wanted == 0].sum() == 0, "sampled a token outside the nucleus"
    assert (wanted > 0.1).sum() >= 2, "the warm model is too sure of this prompt for a useful test"
    assert _chi_square_p_value(counts, samples * wanted) > 1e-4


def _max_logp_gap(model, tokenizer, rollouts):
    """The largest |engine log-prob - trainer log-prob| over the sampled tokens."""
    batch = pack(rollouts, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_logp, _ = completion_logprobs(model, batch)
    return float(((trainer_logp - batch.behaviour_logp) * batch.completion_mask).abs().max())


def test_after_a_sync_every_parameter_is_the_trainers(setup):
    """Each parameter in turn is changed in the trainer, alone, and synced: the engine must then
    sample from exactly the trainer's weights. A parameter the sync misses (a tied output layer, a
    norm, a name the engine does not know) leaves the engine's log-probs off and fails here."""
    engine, model, tokenizer, prompts = setup
    params, seeds = SamplingParams(n=4, max_new_tokens=8), [1, 2, 3]
    generator = torch.Generator().manual_seed(0)
    for name, param in list(model.named_parameters()):
        saved = param.detach().clone()
        before = engine.generate(prompts, params, seeds)
        with torch.no_grad():
            param.add_(torch.randn(param.shape, generator=generator) * (0.5 * saved.std() + 0.2))
        try:
            engine.sync_weights()
            gap = _max_logp_gap(model, tokenizer, engine.generate(prompts, params, seeds))
            assert gap <= logprob_rounding(model), f"{name}: the engine samples from other weights ({gap:.3g} nats)"
            moved = _max_logp_gap(model, tokenizer, before)  # what a stale engine would show
            assert moved > 1e-2, f"{name}: the change is too small to tell a stale engine ({moved:.3g})"
        finally:
            with torch.no_grad():
                param.copy_(saved)
            engine.sync_weights()
    assert _max_logp_gap(model, tokenizer, engine.generate(prompts, params, seeds)) <= logprob_rounding(model)


def test_the_same_seeds_give_the_same_rollouts(setup):
    a, b = _generate(setup, seed=5, n=2, max_new_tokens=8), _generate(setup, seed=5, n=2, max_new_tokens=8)
    c = _generate(setup, seed=6, n=2, max_new_tokens=8)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


def test_a_prompts_completions_depend_on_its_seed_alone(setup):
    """What lets processes split a batch: prompt i samples the same alone as in any batch."""
    engine, model, _, prompts = setup
    params = SamplingParams(n=3, max_new_tokens=10)
    together = engine.generate(prompts, params, [11, 22, 33])
    for i, (prompt, seed) in enumerate(zip(prompts, [11, 22, 33], strict=True)):
        alone = engine.generate([prompt], params, [seed])
        assert alone.token_ids == together.token_ids[3 * i:3 * i + 3]
        for a, b in zip(alone.logprobs, together.logprobs[3 * i:3 * i + 3], strict=True):
            assert a == pytest.approx(b, rel=0, abs=logprob_rounding(model))  # another batch: other rounding
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        engine.generate(prompts, params, [1, 2])


def test_rollouts_round_trip_through_a_plain_state(setup):
    r = _generate(setup, n=2, max_new_tokens=4)
    assert Rollouts.from_state(r.to_state()) == r


