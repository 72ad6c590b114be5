"""Rollouts with a transformers model: batched sampling with a KV cache, on CPU or GPU.

In one process the engine shares the trainer's model object, so it always samples from the current
weights. When the trainer's model is sharded over processes, the engine holds a full replica and
`sync_weights` copies the trainer's weights into it before the next generation. Each prompt samples
from its own seeded generator, which makes runs reproducible, resumable and independent of how
prompts are split over processes.

Everything stays on the model's device (`trainer.rollout.sampling`): a decoding step reads back to
the host only whether any row is still going (with stop strings: that step's tokens), never the
[B, V] log-probs. How the steps run, eager or compiled, is `trainer.rollout.decoding`'s.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Sequence

import torch

from trainer.batch import Rollouts
from trainer.rollout.base import SamplingParams, check_seeds
from trainer.rollout.decoding import CompiledDecodingFailed, Decoder
from trainer.rollout.sampling import RowSampler, sampling_logprobs

__all__ = ["HFEngine", "sampling_logprobs", "sampling_device"]


def sampling_device(model) -> torch.device:
    """The one device that holds all of `model`'s parameters, where the engine samples."""
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) != 1 or devices[0] == "meta":
        where = " and ".join(devices) or "no device (the model has no parameters)"
        raise ValueError(f"hf engine: the model's parameters are on {where}; it samples on the model's device, so "
                         "the whole model must be on one real device (load it with model.device set, not a device map)")
    return torch.device(devices[0])


@contextmanager
def without_input_grad_hooks(model):
    """The model without the forward hooks that make its input embeddings require grad, put back after.

    transformers (5.17) turns gradient checkpointing on with such a hook (`enable_input_require_grads`);
    a rollout needs no gradient, and torch.compile in torch 2.11 cannot trace the hook's requires_grad_
    call, so with it every compiled decoding fell back to eager on a GPU."""
    if not getattr(model, "_require_grads_hooks", None):
        yield
        return
    model.disable_input_require_grads()
    try:
        yield
    finally:
        model.enable_input_require_grads()


class HFEngine:
    """RolloutEngine over a transformers causal LM and its tokenizer."""

    def __init__(self, model, tokenizer,
                 weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
                 decoding: str = "auto") -> None:
        """`model` is the trainer's own model, or (with `weights`, the trainer's full parameters by
        name) a replica that sync_weights refreshes. `decoding`: rollout.hf_decoding (auto, eager,
        compiled; trainer.rollout.decoding)."""
        self.model = model
        self.decoding = decoding
        self.decoder = Decoder(model, sampling_device(model), decoding)
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

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: Sequence[int]) -> Rollouts:
        check_seeds(prompt_ids, seeds)
        if self.stale:
            self._refresh()
        device = sampling_device(self.model)
        if device != self.decoder.device:  # the model moved since the last generation
            self.decoder = Decoder(self.model, device, self.decoding)
        model, pad = self.model, self.tokenizer.pad_token_id
        rows = [ids for ids in prompt_ids for _ in range(params.n)]
        batch, width = len(rows), max(len(ids) for ids in rows)
        input_ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, ids in enumerate(rows):  # left padding: every prompt ends at the same column
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        was_training = model.training
        model.eval()
        # compiled decoding runs under no_grad, as transformers' generate compiles it; eager in inference mode
        try:
            with without_input_grad_hooks(model), torch.no_grad() if self.decoder.compiled else torch.inference_mode():
                try:
                    tokens, logprobs, alive, stopped = self._decode(input_ids, mask, params, seeds)
                except CompiledDecodingFailed as error:  # started over, eagerly, with fresh generators
                    self.decoder.disable(error)
                    tokens, logprobs, alive, stopped = self._decode(input_ids, mask, params, seeds)
        finally:
            model.train(was_training)
        lengths = alive.sum(-1).tolist()
        token_lists = [row[:n] for row, n in zip(tokens.tolist(), lengths, strict=True)]
        logprob_lists = [row[:n] for row, n in zip(logprobs.tolist(), lengths, strict=True)]
        texts = [self._text(ids, params.stop) for ids in token_lists]
        finish = ["stop" if s else "length" for s in stopped.tolist()]
        return Rollouts([list(p) for p in prompt_ids], token_lists, logprob_lists, texts, finish, params.n)

    def _decode(self, input_ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, seeds: Sequence[int]
                ) -> tuple[torch.Tensor, ...]:
        """Sample up to max_new_tokens per row, on the model's device; (tokens, log-probs, alive) [B, steps]
        and stopped [B], on the host. A step synchronises with the host once: whether any row goes on."""
        device, pad = input_ids.device, self.tokenizer.pad_token_id
        batch, width = input_ids.shape
        sampler = RowSampler(seeds, params.n, device)
        session = self.decoder.session(batch, width, params.max_new_tokens)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = session.prefill(input_ids, mask, position)
        position = position[:, -1:]
        # per step, one column of these: the sampled token, its log-prob, and whether the row was still going
        tokens = torch.full((batch, params.max_new_tokens), pad, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, params.max_new_tokens), device=device)
        alive = torch.zeros((batch, params.max_new_tokens), dtype=torch.bool, device=device)
        active = torch.ones(batch, dtype=torch.bool, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=device)
        stop_window = max((len(s) for s in params.stop), default=0)
        completions: list[list[int]] | None = [[] for _ in range(batch)] if stop_window else None
        steps = 0
        for t in range(params.max_new_tokens):
            logp = sampling_logprobs(logits, params.temperature, params.top_p)
            sampled, chosen = sampler.draw(logp)
            tokens[:, t], logprobs[:, t], alive[:, t] = sampled, chosen, active
            steps = t + 1
            ended = torch.isin(sampled, eos) & active
            broken = (~torch.isfinite(chosen) & active).any()
            if completions is None:
                stopped |= ended
                active &= ~ended
                going, broken = torch.stack([active.any(), broken]).tolist()
            else:  # stop strings are matched in text, on the host
                ended, broken = self._stop_strings(completions, sampled, ended, broken, params.stop, stop_window)
                stopped |= ended
                active &= ~ended
                going = any(c is not None for c in completions)
            if broken:
                raise RuntimeError(f"hf engine: the model's log-probs are not finite at decoding step {t + 1} (NaN or "
                                   "inf in its logits): its weights or activations overflowed; try model.dtype "
                                   "float32 or a lower train.lr")
            if not going or steps == params.max_new_tokens:
                break
            position = position + 1
            logits = session.step(torch.where(active, sampled, pad), active, position)
        return tokens[:, :steps].cpu(), logprobs[:, :steps].cpu(), alive[:, :steps].cpu(), stopped.cpu()

    def _stop_strings(self, completions: list[list[int] | None], sampled: torch.Tensor, ended: torch.Tensor,
                      broken: torch.Tensor, stop: tuple[str, ...], window: int) -> tuple[torch.Tensor, bool]:
        """`ended` with the rows whose text now holds a stop string; `completions` holds each going row's
        tokens so far (None once it ended). One read from the device: this step's tokens and ends."""
        *host, broken = torch.cat([sampled, ended.long(), broken.long().unsqueeze(0)]).tolist()
        ids, ends = host[: len(completions)], host[len(completions):]
        for i, completion in enumerate(completions):
            if completion is None:
                continue
            completion.append(ids[i])
            if not ends[i] and self._hits_stop(completion, stop, window):
                ends[i] = 1
            if ends[i]:
                completions[i] = None
        return torch.tensor(ends, dtype=torch.bool, device=sampled.device), bool(broken)

    def _hits_stop(self, ids: list[int], stop: tuple[str, ...], window: int) -> bool:
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def _text(self, ids: list[int], stop: tuple[str, ...]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s in text]
        return text[: min(cuts)] if cuts else text
