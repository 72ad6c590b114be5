"""The regularized objective of the policy being trained, measured on held-out prompts.

Once, before the first update (the policy is then the reference), each of `measure.prompts`
held-out prompts is sampled `measure.reference_samples` times: the histogram of their rewards
gives the optimum J* of each prompt (trainer.measure.optimum). At each measured step, `measure.samples`
completions per prompt are drawn from the policy, and each prompt gets

- its mean reward, and
- KL(pi || pi_ref) of whole completions, Rao-Blackwellized: for each sampled completion, the sum
  over its positions of the full-vocabulary KL between the two next-token distributions. By the
  chain rule (docs/concepts/theory.md, "The reverse KL") its mean over samples of pi is an
  unbiased estimate of the sequence KL, with less variance than the sampled k1 sum; the same stopping
  rule (EOS, stop strings, max_new_tokens) ends sequences under both policies, which the chain rule needs.

pi is the policy at the rollout temperature without top-p, the distribution the objective's
log-probs use. Every measurement uses the same prompts and seeds, so runs are compared on the
same draws. Several training processes measure a share of the prompts each.

When the objective moves as the run trains (docs/peers.md), each line is measured at the beta of
its step (an adaptive beta: the final line gives J* and the gap at the final beta), and always
against the reference the run started from (a refreshed reference: the gap to the original
reference's optimum, which shows how far the run departs from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eval.verify import Verifier
from trainer.batch import Rollouts, pack
from trainer.config import RunConfig
from trainer.distributed import World
from trainer.measure.optimum import Histogram, mean_se, objective_gap, reference_value
from trainer.model.logprobs import CompletionLogprobs
from trainer.rollout.base import RolloutEngine, SamplingParams, sample_seeds
from trainer.tasks import DataOrder, make_task

VOCAB_BUDGET = 1 << 24  # log-prob entries (rows x positions x vocabulary) one full-vocabulary pass holds


def histogram(rewards: list[float]) -> list[tuple[float, int]]:
    """Reward values and their counts, sorted by value."""
    counts: dict[float, int] = {}
    for reward in rewards:
        counts[float(reward)] = counts.get(float(reward), 0) + 1
    return sorted(counts.items())


@torch.no_grad()
def sequence_kl(policy: CompletionLogprobs, reference: CompletionLogprobs, rollouts: Rollouts, pad_id: int,
                device: torch.device, max_length: int) -> list[float]:
    """Per completion: the sum over its positions of KL(pi(. | prefix) || pi_ref(. | prefix)), over the
    whole vocabulary, a few rows at a time: at most VOCAB_BUDGET log-probs per model at once for
    completions of up to `max_length` tokens (a row count that every process shares, so that sharded
    models see as many forward passes on each)."""
    batch = pack(rollouts, pad_id).to(device)
    rows = batch.completion_ids.shape[0]
    vocabulary = policy.lm.get_output_embeddings().weight.shape[0]
    step = max(1, VOCAB_BUDGET // (max_length * vocabulary))
    sums = []
    for start in range(0, rows, step):
        part = batch.rows(slice(start, start + step))
        logp, _ = policy(part, whole_vocabulary=True)
        ref_logp, _ = reference(part, whole_vocabulary=True)
        per_token = (logp.exp() * (logp - ref_logp)).sum(-1) * part.completion_mask
        sums += per_token.sum(-1).double().tolist()
    return sums


@dataclass
class HeldOut:
    """This process's share of the held-out prompts: token ids, problems and one seed per prompt."""

    prompt_ids: list[list[int]]
    problems: list
    seeds: list[int]


class ObjectiveProbe:
    """Measures reward, KL to the reference and the objective gap for one run (`measure` config)."""

    def __init__(self, config: RunConfig, tokenizer, world: World) -> None:
        m = config.measure
        self.config, self.world, self.tokenizer = config, world, tokenizer
        self.task = make_task(config.task.name, {**config.task.options, **m.task_options})
        indices = DataOrder(len(self.task), m.seed).take(0, m.prompts)
        seeds = sample_seeds(m.seed, 0, m.prompts)
        lo, hi = world.rank * m.prompts // world.size, (world.rank + 1) * m.prompts // world.size
        problems = [self.task.problem(i) for i in indices[lo:hi]]
        self.held_out = HeldOut(self.task.prompt_ids(problems, tokenizer, config.model.chat_template), problems,
                                seeds[lo:hi])
        self.indices = indices
        o = config.objective  # the reference's coefficient: a KL to mu alone (kl_to behaviour) regularizes toward none
        self.beta = o.beta if o.placement != "none" and o.kl_to != "behaviour" else None

    def _params(self, n: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(n=n, temperature=r.temperature, top_p=1.0, max_new_tokens=r.max_new_tokens,
                              stop=tuple(r.stop))

    def _sample(self, engine: RolloutEngine, n: int, verifier: Verifier) -> list[tuple[Rollouts, list[float]]]:
        """`n` completions of each of this process's prompts and their rewards, a training batch's worth
        of completions at a time (each prompt samples from its own seed, so the split changes nothing)."""
        held, t = self.held_out, self.config.train
        size = max(1, t.prompts_per_step * t.group_size // self.world.size // n)
        chunks = []
        for start in range(0, len(held.seeds), size):
            part = slice(start, start + size)
            rollouts = engine.generate(held.prompt_ids[part], self._params(n), held.seeds[part])
            expanded = [p for p in held.problems[part] for _ in range(n)]
            chunks.append((rollouts, self.task.reward(rollouts.texts, expanded, verifier)))
        return chunks

    def reference_record(self, engine: RolloutEngine, verifier: Verifier) -> dict[str, Any]:
        """Call while the policy is still the reference: the reward histogram of every prompt (whole,
        on every process)."""
        n = self.config.measure.reference_samples
        rewards = [r for _, part in self._sample(engine, n, verifier) for r in part]
        mine = [histogram(rewards[i * n:(i + 1) * n]) for i in range(len(self.held_out.seeds))]
        histograms = [h for part in self.world.gather(mine) for h in part]
        return {"task": self.task.name, "options": {**self.config.task.options, **self.config.measure.task_options},
                "indices": self.indices, "samples": n, "histograms": histograms}

    def measure(self, step: int, engine: RolloutEngine, policy: CompletionLogprobs, reference: CompletionLogprobs,
                verifier: Verifier, device: torch.device, reference_record: dict[str, Any],
                beta: float | None = None) -> dict[str, Any]:
        """One line of objective.jsonl: per-prompt mean reward and KL, and their summary at the run's beta
        (`beta`: the beta of this step, when it adapts; the line records it)."""
        n, rewards, kls = self.config.measure.samples, [], []
        for rollouts, part in self._sample(engine, n, verifier):
            rewards += part
            kls += sequence_kl(policy, reference, rollouts, self.tokenizer.pad_token_id, device,
                               self.config.rollout.max_new_tokens)
        count = len(self.held_out.seeds)
        mine = ([sum(rewards[i * n:(i + 1) * n]) / n for i in range(count)],
                [sum(kls[i * n:(i + 1) * n]) / n for i in range(count)])
        parts = self.world.gather(mine)
        per_prompt = {"reward": [r for p in parts for r in p[0]], "kl": [k for p in parts for k in p[1]]}
        return summarize(step, self.beta if self.beta is None or beta is None else beta,
                         reference_record["histograms"], per_prompt, n)


def summarize(step: int, beta: float | None, histograms: list[Histogram], per_prompt: dict[str, list[float]],
              samples: int) -> dict[str, Any]:
    """The measurement's summary (at the run's beta, when it has one) and its per-prompt values."""
    line: dict[str, Any] = {"step": step, "prompts": len(histograms), "samples": samples}
    reference_reward = [reference_value(h) for h in histograms]
    line["reference_reward"] = sum(reference_reward) / len(reference_reward)
    if beta is not None:
        line["beta"] = beta
        measured = objective_gap(histograms, per_prompt["reward"], per_prompt["kl"], beta)
        line.update({key: value for key, value in measured.items() if key != "beta"})
        line["reference_gap"] = objective_gap(histograms, reference_reward, [0.0] * len(histograms), beta)["gap"]
    else:
        for name in ("reward", "kl"):
            line[name], line[f"{name}_se"] = mean_se(per_prompt[name])
    line["per_prompt"] = per_prompt
    return line
