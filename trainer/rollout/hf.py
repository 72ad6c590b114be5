"""Rollouts with a transformers model: batched sampling with a KV cache, on CPU or GPU.

In one process the engine shares the trainer's model object, so it always samples from the current
weights. When the trainer's model is sharded over processes, the engine holds a full replica and
`sync_weights` copies the trainer's weights into it before the next generation. Each prompt samples
from its own seeded torch.Generator, which makes runs reproducible, resumable and independent of
how prompts are split over processes.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from trainer.rollout.base import Rollouts, SamplingParams, check_seeds


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from: logits / temperature, then nucleus (float32, or
    float64 for float64 logits: the exact audit samples with it too)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()  # mass strictly before each token
    sorted_logp = sorted_logp.masked_fill(before >= top_p, float("-inf"))  # the top token always stays
    kept = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
    return torch.log_softmax(kept, dim=-1)


class HFEngine:
    """RolloutEngine over a transformers causal LM and its tokenizer."""

    def __init__(self, model, tokenizer,
                 weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None) -> None:
        """`model` is the trainer's own model, or (with `weights`, the trainer's full parameters by
        name) a replica that sync_weights refreshes."""
        self.model = model
        self.tokenizer = tokenizer
        self.weights = weights
        self.stale = False
        configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        configured = configured if isinstance(configured, (list, tuple)) else [configured]
        self.eos_ids = {i for i in (tokenizer.eos_token_id, *configured) if i is not None}

    def sync_weights(self) -> None:
        """A replica is refreshed lazily, at the next generate(); a shared model needs nothing."""
        self.stale = self.weights is not None

    def close(self) -> None:
        """Nothing to release: the model belongs to the trainer (or is a plain replica)."""

    @torch.no_grad()
    def _refresh(self) -> None:
        for name, tensor in self.weights():
            self.model.get_parameter(name).copy_(tensor)
        self.stale = False

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: Sequence[int]) -> Rollouts:
        check_seeds(prompt_ids, seeds)
        if self.stale:
            with torch.inference_mode(False):
                self._refresh()
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        model, pad = self.model, self.tokenizer.pad_token_id
        device = next(model.parameters()).device
        rows = [ids for ids in prompt_ids for _ in range(params.n)]
        batch, width = len(rows), max(len(ids) for ids in rows)
        input_ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, ids in enumerate(rows):  # left padding: every prompt ends at the same column
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        was_training = model.training
        model.eval()
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[:, -1]
        position = position[:, -1:]
        # per step, one column of these: the sampled token, its log-prob, and whether the row was still going
        tokens = torch.full((batch, params.max_new_tokens), pad, dtype=torch.long)
        logprobs = torch.zeros((batch, params.max_new_tokens))
        alive = torch.zeros((batch, params.max_new_tokens), dtype=torch.bool)
        active = torch.ones(batch, dtype=torch.bool)
        stopped = torch.zeros(batch, dtype=torch.bool)
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        stop_window = max((len(s) for s in params.stop), default=0)
        steps = 0
        for t in range(params.max_new_tokens):
            logp = sampling_logprobs(logits, params.temperature, params.top_p).cpu()
            probs = logp.exp()
            sampled = torch.cat([torch.multinomial(probs[i * params.n:(i + 1) * params.n], 1, generator=g)
                                 for i, g in enumerate(generators)])
            tokens[:, t] = sampled.squeeze(-1)
            logprobs[:, t] = logp.gather(-1, sampled).squeeze(-1)
            alive[:, t] = active
            steps = t + 1
            ended = torch.isin(tokens[:, t], eos) & active
            if stop_window:
                for i in torch.nonzero(active & ~ended).flatten().tolist():
                    if self._hits_stop(tokens[i, : t + 1][alive[i, : t + 1]].tolist(), params.stop, stop_window):
                        ended[i] = True
            stopped |= ended
            active &= ~ended
            if not active.any():
                break
            step_ids = torch.where(active, tokens[:, t], pad).unsqueeze(-1).to(device)
            mask = torch.cat([mask, active.long().unsqueeze(-1).to(device)], dim=-1)
            position = position + 1
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=position, past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[:, -1]
        model.train(was_training)
        lengths = alive[:, :steps].sum(-1).tolist()
        token_lists = [row[:n] for row, n in zip(tokens[:, :steps].tolist(), lengths, strict=True)]
        logprob_lists = [row[:n] for row, n in zip(logprobs[:, :steps].tolist(), lengths, strict=True)]
        texts = [self._text(ids, params.stop) for ids in token_lists]
        finish = ["stop" if s else "length" for s in stopped.tolist()]
        return Rollouts([list(p) for p in prompt_ids], token_lists, logprob_lists, texts, finish, params.n)

    def _hits_stop(self, ids: list[int], stop: tuple[str, ...], window: int) -> bool:
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def _text(self, ids: list[int], stop: tuple[str, ...]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s in text]
        return text[: min(cuts)] if cuts else text
