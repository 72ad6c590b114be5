"""The measured objective: the Rao-Blackwellized sequence KL by exact enumeration, and the probe."""


import pytest
import torch
from rounding import logprob_rounding, rounding

from eval.verify import Verifier
from trainer import config as run_config
from trainer.batch import Rollouts, pack
from trainer.distributed import World
from trainer.measure.objective import ObjectiveProbe, histogram, sequence_kl
from trainer.measure.optimum import optimal_value
from trainer.model.logprobs import CompletionLogprobs, completion_logprobs
from trainer.model.models import load_model, load_tokenizer
from trainer.rollout.hf import HFEngine


def every_completion(vocabulary, stops, length):
    """All completions of up to `length` tokens that end at a stop token or at the length limit."""
    done, growing = [], [[]]
    for _ in range(length):
        longer = [prefix + [t] for prefix in growing for t in range(vocabulary)]
        done += [c for c in longer if c[-1] in stops]
        growing = [c for c in longer if c[-1] not in stops]
    return done + growing


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_the_mean_of_the_rao_blackwellized_kl_is_the_sequence_kl(model_and_perturbed_copy, temperature):
    """Over every completion of up to 2 tokens (EOS and a stop token end one early), in float64:
    sum_y pi(y) * sum_t KL_t(y) = sum_y pi(y) log(pi(y) / pi_ref(y)) exactly (the chain rule)."""
    policy_lm, reference_lm = model_and_perturbed_copy
    vocabulary = policy_lm.get_output_embeddings().weight.shape[0]
    completions = every_completion(vocabulary, stops={2, 17}, length=2)
    rollouts = Rollouts(prompt_ids=[[1, 5, 6, 7]], token_ids=completions, n=len(completions),
                        logprobs=[[0.0] * len(c) for c in completions], texts=[""] * len(completions),
                        finish_reasons=["stop"] * len(completions))
    batch = pack(rollouts, pad_id=0)
    logp = completion_logprobs(policy_lm, batch, temperature)[0].detach().sum(-1)
    ref_logp = completion_logprobs(reference_lm, batch, temperature)[0].detach().sum(-1)
    probs = logp.exp()
    # the enumeration is complete: probabilities of up to two log-probs each, summing to 1 to their rounding
    noise = 2 * logprob_rounding(policy_lm, torch.float64) + rounding(1.0, len(completions))
    assert abs(float(probs.sum()) - 1.0) <= noise
    exact = float((probs * (logp - ref_logp)).sum())
    per_completion = torch.tensor(sequence_kl(CompletionLogprobs(policy_lm, temperature),
                                              CompletionLogprobs(reference_lm, temperature), rollouts, 0,
                                              torch.device("cpu"), max_length=2), dtype=torch.float64)
    assert exact > 1e-3 and (per_completion >= 0).all()
    assert float((probs * per_completion).sum()) == pytest.approx(exact, rel=1e-10)
    # a single sampled k1 sum can be negative; the Rao-Blackwellized one never is, and it varies less
    k1 = logp - ref_logp
    variance = {name: float((probs * (x - exact) ** 2).sum()) for name, x in (("k1", k1), ("rb", per_completion))}
    assert variance["rb"] < variance["k1"], variance


def test_a_policy_equal_to_its_reference_measures_zero_kl_and_the_reference_gap(warm_model):
    config = run_config.from_dict({
        "model": {"path": str(warm_model)}, "task": {"options": {"max_operand": 9}},
        "objective": {"estimator": "k1", "placement": "reward", "beta": 0.5},
        "rollout": {"max_new_tokens": 4, "stop": ["\n"]}, "train": {"prompts_per_step": 2, "group_size": 8},
        "measure": {"prompts": 6, "samples": 8, "reference_samples": 8, "task_options": {"seed": 3}}})
    tokenizer, lm = load_tokenizer(str(warm_model)), load_model(str(warm_model))
    probe = ObjectiveProbe(config, tokenizer, World())
    engine, model, verifier = HFEngine(lm, tokenizer), CompletionLogprobs(lm), Verifier(workers=1)
    try:
        reference = probe.reference_record(engine, verifier)
        line = probe.measure(7, engine, model, model, verifier, torch.device("cpu"), reference)
    finally:
        verifier.close()
    assert reference["samples"] == 8 and len(reference["histograms"]) == 6 and reference["options"]["seed"] == 3
    assert line["step"] == 7 and line["kl"] == 0.0 and line["per_prompt"]["kl"] == [0.0] * 6
    # same prompts and seeds: the policy's first 8 samples are the reference's 8
    assert line["reward"] == line["reference_reward"]
    optimum = sum(optimal_value(h, 0.5) for h in reference["histograms"]) / 6
    assert line["optimum"] == pytest.approx(optimum) and line["gap"] == pytest.approx(line["reference_gap"])
    assert line["gap"] > 0


def test_histogram_counts_reward_values():
    assert histogram([1.0, 0.0, 1.0, 0.5]) == [(0.0, 1), (0.5, 1), (1.0, 2)]
