"""The rollout contract on a real model: SmolLM2-135M-Instruct (byte-level BPE, a chat template, tied
embeddings, pad = EOS = <|im_end|>), with hf (the trainer's own model, and a replica synced from it) and
vLLM's CPU build. One model and one engine of each kind serve the whole module."""

import copy
import math

import pytest
import torch
from vllm_required import require_vllm

from trainer.batch import pack
from trainer.model.logprobs import completion_logprobs
from trainer.model.models import load_model, load_tokenizer
from trainer.rollout.base import SamplingParams, sample_seeds
from trainer.tasks import make_task

ENGINES = ("hf", "hf-replica", "vllm")
# vLLM computes in its own kernels (and the CPU build repacks the weights for them): float32 agrees with
# the trainer to about 1e-5 nats a token on SmolLM2; hf is the trainer's own forward pass
LOGP_TOLERANCE = {"hf": 1e-4, "hf-replica": 1e-4, "vllm": 1e-3}


@pytest.fixture(scope="module")
def smol(smollm2):
    return load_model(str(smollm2)), load_tokenizer(str(smollm2))


@pytest.fixture(scope="module")
def engines(smollm2, smol):
    """engines(name): the module's engine of that kind, made on first use; all closed at the end."""
    from trainer.distributed import World, full_parameters
    from trainer.rollout.hf import HFEngine

    model, tokenizer = smol
    made = {}

    def get(name):
        if name not in made:
            if name == "hf":
                made[name] = HFEngine(model, tokenizer)
            elif name == "hf-replica":
                made[name] = HFEngine(copy.deepcopy(model), tokenizer, weights=lambda: full_parameters(model))
            else:
                require_vllm()
                from trainer import config as run_config
                from trainer.rollout import make_engine

                config = run_config.load(None, [f"model.path={smollm2}", "rollout.engine=vllm",
                                                "rollout.vllm_max_model_len=512"])
                made[name] = make_engine(config, model, tokenizer, World(), weights=lambda: full_parameters(model))
            made[name].name = name
        return made[name]

    yield get
    for engine in made.values():
        engine.close()


@pytest.fixture(params=ENGINES)
def engine(request, engines):
    return engines(request.param)


def chat_prompts(tokenizer, count=3, task="arithmetic", **options):
    """The trainer's prompts: a natural-language task's problems through the chat template."""
    task = make_task(task, {"prompt": "natural", "seed": 5, **options})
    return task.prompt_ids([task.problem(i) for i in range(count)], tokenizer, chat=True)


def logp_gap(model, tokenizer, rollouts) -> float:
    """The largest |engine log-prob - trainer log-prob| over the sampled tokens."""
    batch = pack(rollouts, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_logp, _ = completion_logprobs(model, batch)
    return float(((trainer_logp - batch.behaviour_logp) * batch.completion_mask).abs().max())


def test_chat_prompts_start_with_one_bos_and_end_in_the_assistants_turn(smol):
    """No BOS added twice: the chat template writes <|im_start|> itself, and encoding adds nothing more;
    the ids decode back to exactly the rendered text, which encodes to the same ids."""
    _, tokenizer = smol
    task = make_task("countdown", {"prompt": "natural", "count": 3})
    problem = task.problem(0)
    text = task.prompt(problem, tokenizer, chat=True)
    ids = task.prompt_ids([problem], tokenizer, chat=True)[0]
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids[1] != start
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(ids) == text and tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    assert ids[-4:] == tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert problem.question in text and "\\boxed{}" in text


def test_completions_end_at_im_end_which_is_trained_while_padding_is_not(engine, smol):
    """pad = EOS = <|im_end|>: a completion that ended keeps its EOS as a sampled, trained token with
    the engine's log-prob; the padding after shorter completions (the same token id) is masked out."""
    model, tokenizer = smol
    prompts = chat_prompts(tokenizer, 4, max_operand=9)
    r = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=48), sample_seeds(1, 0, len(prompts)))
    eos = tokenizer.eos_token_id
    assert eos == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = [tokens for tokens, reason in zip(r.token_ids, r.finish_reasons, strict=True) if reason == "stop"]
    assert len(ended) >= 4, r.finish_reasons  # SmolLM2 answers 1-digit sums briefly
    assert all(tokens[-1] == eos and eos not in tokens[:-1] for tokens in ended)
    assert all("<|im_end|>" not in text for text in r.texts)
    batch = pack(r, tokenizer.pad_token_id)
    lengths = [len(tokens) for tokens in r.token_ids]
    assert min(lengths) < max(lengths)  # some rows are padded
    for row, tokens in enumerate(r.token_ids):
        mask = batch.completion_mask[row]
        assert mask[:len(tokens)].eq(1).all() and mask[len(tokens):].eq(0).all()
        assert batch.completion_ids[row, len(tokens):].eq(eos).all()  # padding: the same id, masked
    with torch.no_grad():
        trainer_logp, _ = completion_logprobs(model, batch)
    for row, tokens in enumerate(r.token_ids):
        if tokens[-1] == eos:  # the EOS's own log-prob is in the loss, and is the engine's
            assert math.isfinite(trainer_logp[row, len(tokens) - 1]) and trainer_logp[row, len(tokens) - 1] < 0
    gap = ((trainer_logp - batch.behaviour_logp) * batch.completion_mask).abs().max()
    assert gap < LOGP_TOLERANCE[engine.name]


def test_the_tokens_the_engine_produced_are_exactly_what_the_trainer_scores(engine, smol):
    """The trainer scores [prompt ids | completion ids] as the engine had them, never a re-encoding of
    the text (which may merge tokens across the boundary or differ from what was sampled)."""
    _, tokenizer = smol
    prompts = chat_prompts(tokenizer, 3, max_operand=50)
    r = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=24), sample_seeds(2, 0, len(prompts)))
    batch = pack(r, tokenizer.pad_token_id)
    for row, tokens in enumerate(r.token_ids):
        prompt = prompts[row // 2]
        kept = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        assert kept == prompt + tokens
        assert kept[:2] != [tokenizer.bos_token_id] * 2


def test_vllm_samples_batches_longer_than_its_prefill_budget(engines, smol):
    """Sixteen chat prompts x 8 samples: over 5,000 prompt tokens, more than vLLM's CPU build prefills in
    one step (4,096). Its scheduler used to split a prompt's prefill over steps there, and a seeded
    request then crashed it ("CPU Generator does not use offset"). (hf has no prefill budget.)"""
    model, tokenizer = smol
    engine = engines("vllm")
    prompts = chat_prompts(tokenizer, 16, max_operand=20)
    assert sum(len(p) for p in prompts) * 8 > 4096
    r = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=2), sample_seeds(3, 0, len(prompts)))
    assert len(r) == 128 and all(len(t) >= 1 for t in r.token_ids)
    assert logp_gap(model, tokenizer, r) < LOGP_TOLERANCE["vllm"]
    again = engine.generate(prompts[5:6], SamplingParams(n=8, max_new_tokens=2), sample_seeds(3, 5, 1))
    assert again.token_ids == r.token_ids[40:48]  # a prompt's samples depend on its seed alone


def test_after_a_sync_the_engine_samples_from_every_perturbed_tensor(engine, smol):
    """Every tensor of the tied model moves (the shared embedding and output layer once, by the same
    noise), the engine is told to sync, and its log-probs are the trainer's again; before the sync
    they were far off. A tensor the sync misses (the output layer that vLLM keeps apart from the
    embedding, a norm) leaves the log-probs off."""
    model, tokenizer = smol
    prompts = chat_prompts(tokenizer, 2)
    params, seeds = SamplingParams(n=3, max_new_tokens=12), sample_seeds(4, 0, 2)
    before = engine.generate(prompts, params, seeds)
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.05 * p.std())
        if engine.name != "hf":  # the trainer's own model: the engine samples from it as it is
            stale = engine.generate(prompts, params, seeds)
            assert logp_gap(model, tokenizer, stale) > 1e-2, "the engine followed the change without a sync"
        engine.sync_weights()
        synced = engine.generate(prompts, params, seeds)
        assert logp_gap(model, tokenizer, synced) < LOGP_TOLERANCE[engine.name]
        assert logp_gap(model, tokenizer, before) > 1e-2  # the change was large enough to tell
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(saved[name])
        engine.sync_weights()
    assert logp_gap(model, tokenizer, engine.generate(prompts, params, seeds)) < LOGP_TOLERANCE[engine.name]
