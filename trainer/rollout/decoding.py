"""The hf engine's decoding: its KV cache and its one-token forward, eager or compiled.

eager     transformers' DynamicCache concatenates every step's keys and values onto the whole cache,
          a copy of all of it per token (40% of the toy's generation time on CPU). Here its layers
          write into buffers allocated once per generation and hand the model views of the filled
          part: the same values in the same shapes, so the same logits to the bit, without the copies.
compiled  a StaticCache, one fixed shape per batch size and power-of-two length, kept and reused by
          the engine, and the one-token forward through torch.compile (mode reduce-overhead on CUDA:
          replayed as a CUDA graph). The compiled function belongs to the process: every engine and
          every run in it share it, so each shape compiles once per process. Its logits differ from
          eager decoding by rounding.

rollout.hf_decoding picks: auto (compiled on CUDA, eager elsewhere), eager, compiled. A model whose
transformers class cannot compile with a static cache decodes eagerly, and so does every engine of
the process after a compilation fails (one warning; the generation that hit it starts over eagerly).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

SMALLEST_STATIC_LENGTH = 64
_failures: list[str] = []  # why compiling failed in this process (then nothing compiles again)


class CompiledDecodingFailed(RuntimeError):
    """The compiled forward could not be compiled or run; the caller decodes eagerly instead."""


def compile_failure() -> str | None:
    """Why compiling failed in this process (then every engine decodes eagerly), or None."""
    return _failures[0] if _failures else None


def _full_attention_layer():
    """transformers' growing cache layer, or None where this transformers has none (before 4.54)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None
    return DynamicLayer


@functools.cache
def _growing_layer_class():
    base = _full_attention_layer()
    if base is None:
        return None

    class GrowingLayer(base):
        """A DynamicLayer that writes into buffers of `capacity` positions instead of concatenating."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._key_buffer = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[3]))
                self._value_buffer = value_states.new_empty(
                    (*value_states.shape[:2], self.capacity, value_states.shape[3]))
            start = self.get_seq_length()
            end = start + key_states.shape[-2]
            if end > self.capacity:  # more than planned: grow by concatenation, as transformers does
                return super().update(key_states, value_states, *args, **kwargs)
            self._key_buffer[:, :, start:end].copy_(key_states)
            self._value_buffer[:, :, start:end].copy_(value_states)
            self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
            return self.keys, self.values

    try:  # the parts of DynamicLayer it builds on are transformers' internals: check them once
        layer, states = GrowingLayer(3), torch.arange(8.0).view(1, 2, 2, 2)
        layer.update(states, states)
        keys, _ = layer.update(states[:, :, :1], states[:, :, :1])
        assert layer.get_seq_length() == 3 and torch.equal(keys[:, :, :2], states)
        assert torch.equal(keys[:, :, 2], states[:, :, 0])
    except Exception as error:  # this transformers' DynamicLayer works otherwise
        log.info("hf engine: transformers' DynamicLayer is not as expected (%s): its own cache", error)
        return None
    return GrowingLayer


def growing_cache(model, capacity: int):
    """A DynamicCache for `model` whose layers fill buffers of `capacity` positions, or None (let the
    model build its own cache) where its layers are not all plain full-attention DynamicLayers."""
    layer_class = _growing_layer_class()
    if layer_class is None:
        return None
    from transformers.cache_utils import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    if not cache.layers or any(type(layer) is not layer_class.__base__ for layer in cache.layers):
        return None  # sliding windows, linear attention, ...: transformers' own layers
    cache.layers = [layer_class(capacity) for _ in cache.layers]
    return cache


@functools.cache
def _static_layer_class():
    """transformers' StaticLayer and a subclass of it that takes keys and values of two dtypes, or None."""
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:
        return None

    class PromotingStaticLayer(StaticLayer):
        """A StaticLayer that holds keys and values in the dtype both convert to exactly. Under bf16 autocast
        a Llama's keys leave the rotary embedding in float32 and its values in bfloat16; transformers'
        layer holds both in the keys' dtype and cannot write the values. Held in float32, the values are
        the ones the eager cache holds, and attention, which autocast runs in bfloat16, sees the same."""

        def update(self, key_states, value_states, *args, **kwargs):
            if getattr(self, "is_initialized", False):
                dtype = self.dtype
            else:
                dtype = torch.promote_types(key_states.dtype, value_states.dtype)
            return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

    return StaticLayer, PromotingStaticLayer


def static_cache(model, length: int):
    """transformers' StaticCache for `model`, `length` positions, whose plain layers take keys and values
    of two dtypes (PromotingStaticLayer)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    classes = _static_layer_class()
    if classes is not None:
        plain, promoting = classes
        for layer in getattr(cache, "layers", ()):
            if type(layer) is plain:
                layer.__class__ = promoting  # it adds no state: the same layer, updated by the subclass
    return cache


def static_length(needed: int) -> int:
    """The static cache's length for `needed` positions: a power of two, so that few shapes compile."""
    return max(SMALLEST_STATIC_LENGTH, 1 << (needed - 1).bit_length())


def _one_token(model, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


@functools.cache
def compiled_one_token(mode: str | None):
    """The process's compiled one-token forward (one per mode): a function of the model, so that every
    engine and run of the process shares its compiled code."""
    return torch.compile(_one_token, mode=mode, fullgraph=True, dynamic=False)


def compile_mode(device: torch.device) -> str | None:
    """reduce-overhead (CUDA graphs) on CUDA; inductor's default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def wants_compiled(setting: str, model, device: torch.device) -> tuple[bool, str]:
    """Whether to decode compiled, and the log line that says how and why."""
    name = type(model).__name__
    if setting == "eager" or (setting == "auto" and device.type != "cuda"):
        why = "rollout.hf_decoding eager" if setting == "eager" else "rollout.hf_decoding auto compiles on CUDA only"
        return False, f"hf engine: eager decoding on {device} ({why})"
    if _failures:
        return False, f"hf engine: eager decoding on {device} (compiling failed earlier: {_failures[0]})"
    if not getattr(model, "_can_compile_fullgraph", False):
        return False, f"hf engine: eager decoding on {device} ({name} cannot compile with a static KV cache)"
    return True, (f"hf engine: compiled decoding on {device} (static KV cache, torch.compile mode "
                  f"{compile_mode(device) or 'default'})")


class Decoder:
    """One engine's way of decoding: sessions over its model, eager or compiled."""

    def __init__(self, model, device: torch.device, setting: str = "auto") -> None:
        self.model, self.device = model, device
        self.compiled, line = wants_compiled(setting, model, device)
        log.info(line)
        self._static: dict[int, object] = {}  # batch size -> its StaticCache (the length only grows)

    def session(self, batch: int, width: int, max_new_tokens: int, compiled: bool | None = None) -> "Session":
        """A generation's decoding state for `batch` rows of `width` prompt positions."""
        compiled = self.compiled if compiled is None else compiled
        if not compiled:
            capacity = width + max_new_tokens
            return Session(self.model, growing_cache(self.model, capacity), self._mask(batch, capacity), width, None)
        try:
            cache = self._static_cache(batch, static_length(width + max_new_tokens))
        except Exception as error:  # a config that transformers' StaticCache cannot hold
            self.disable(error)
            return self.session(batch, width, max_new_tokens, compiled=False)
        mask = self._mask(batch, cache.get_max_length())
        return Session(self.model, cache, mask, width, compiled_one_token(compile_mode(self.device)))

    def _static_cache(self, batch: int, length: int):
        """The engine's static cache for `batch` rows, emptied; a longer one replaces it when `length` needs."""
        cache = self._static.get(batch)
        if cache is not None and cache.get_max_length() >= length:
            cache.reset()
            return cache
        self._static.pop(batch, None)  # the old one's memory first
        cache = self._static[batch] = static_cache(self.model, length)
        return cache

    def _mask(self, batch: int, length: int) -> torch.Tensor:
        return torch.zeros((batch, length), dtype=torch.long, device=self.device)

    def disable(self, error: BaseException) -> None:
        """Decode eagerly from now on, in every engine of the process: compiling `error`ed."""
        while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
            error = inner  # dynamo wraps what a backend raised
        message = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
        if not _failures:
            log.warning("hf engine: compiled decoding failed (%s); decoding eagerly from now on", reason)
            _failures.append(reason)
        self.compiled = False
        self._static.clear()


class Session:
    """One generation's KV cache and attention mask, and its forward passes.

    `mask` has a column per cache position: the prompt's padding mask, then one column per decoding
    step (whether the row was still going). The eager forward sees the columns filled so far; the
    compiled one sees all of them (fixed shape), the ones not yet filled masked out.
    """

    def __init__(self, model, cache, mask: torch.Tensor, width: int, compiled) -> None:
        self.model, self.cache, self.mask, self.width, self.compiled = model, cache, mask, width, compiled
        self.filled = width

    def prefill(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The prompts' forward, filling the cache; the last position's logits [B, V]."""
        self.mask[:, : self.width] = prompt_mask
        if self.compiled is None:
            out = self.model(input_ids=input_ids, attention_mask=self.mask[:, : self.width], position_ids=position,
                             past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            self.cache = out.past_key_values  # the model's own where it was given none
            return out.logits[:, -1]
        try:  # eager, into the static cache
            return _one_token(self.model, input_ids, self.mask, position, self.cache)
        except Exception as error:
            raise CompiledDecodingFailed(str(error)) from error

    def step(self, token_ids: torch.Tensor, active: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One token per row (`active`: the rows still going, whose token counts); its logits [B, V]."""
        self.mask[:, self.filled] = active
        self.filled += 1
        if self.compiled is None:
            return _one_token(self.model, token_ids.unsqueeze(-1), self.mask[:, : self.filled], position, self.cache)
        torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are read already
        try:
            logits = self.compiled(self.model, token_ids.unsqueeze(-1), self.mask, position, self.cache)
        except Exception as error:  # dynamo, inductor, a C++ or Triton compiler, CUDA graphs: many types
            raise CompiledDecodingFailed(str(error)) from error
        return logits.clone()  # a CUDA graph's output is overwritten by its next replay
