"""Rollouts with a transformers model: batched sampling with a KV cache, on CPU or GPU.

The engine shares the trainer's model object, so it always samples from the current weights. It
samples with an explicit torch.Generator, which makes runs reproducible and resumable bit for bit.
"""

from __future__ import annotations

import torch

from trainer.rollout.base import Rollouts, SamplingParams


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from: logits / temperature, then nucleus."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()  # mass strictly before each token
    sorted_logp = sorted_logp.masked_fill(before >= top_p, float("-inf"))  # the top token always stays
    kept = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
    return torch.log_softmax(kept, dim=-1)


class HFEngine:
    """RolloutEngine over a transformers causal LM and its tokenizer."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        configured = configured if isinstance(configured, (list, tuple)) else [configured]
        self.eos_ids = {i for i in (tokenizer.eos_token_id, *configured) if i is not None}

    def sync_weights(self) -> None:
        """Nothing to do: the engine samples from the trainer's own model."""

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator) -> Rollouts:
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
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        was_training = model.training
        model.eval()
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        next_position = positions[:, -1:] + 1
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        active = torch.ones(batch, dtype=torch.bool)
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long) if self.eos_ids else None
        stop_window = max((len(s) for s in params.stop), default=0)
        for _ in range(params.max_new_tokens):
            logp = sampling_logprobs(logits, params.temperature, params.top_p)
            probs = logp.exp().cpu()
            sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            chosen = logp.cpu().gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
            for i in torch.nonzero(active).flatten().tolist():
                token = int(sampled[i])
                tokens[i].append(token)
                logprobs[i].append(float(chosen[i]))
                if eos is not None and token in self.eos_ids:
                    finish[i], active[i] = "stop", False
                elif stop_window and self._hits_stop(tokens[i], params.stop, stop_window):
                    finish[i], active[i] = "stop", False
            if not active.any():
                break
            step_ids = torch.where(active, sampled, torch.full_like(sampled, pad)).unsqueeze(-1).to(device)
            mask = torch.cat([mask, active.long().unsqueeze(-1).to(device)], dim=-1)
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=next_position,
                        past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
            next_position = next_position + 1
        model.train(was_training)
        texts = [self._text(ids, params.stop) for ids in tokens]
        return Rollouts([list(p) for p in prompt_ids], tokens, logprobs, texts, finish, params.n)

    def _hits_stop(self, ids: list[int], stop: tuple[str, ...], window: int) -> bool:
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def _text(self, ids: list[int], stop: tuple[str, ...]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s in text]
        return text[: min(cuts)] if cuts else text
