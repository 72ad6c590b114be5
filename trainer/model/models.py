"""Load causal LMs and their tokenizers (local directory or hub id), and build the toy model.

The toy model is a character-level tokenizer (every printable ASCII character is a token) and a
small Llama, saved with save_pretrained so that AutoModelForCausalLM, AutoTokenizer and lm-eval's
`hf` backend load it like any other model.
"""

from __future__ import annotations

import logging
import os
import shutil
import string
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Iterator

import torch

from trainer.model import model_source
from trainer.model.toy_spec import ToyModelSpec

log = logging.getLogger(__name__)

TOY_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
TOY_CHARACTERS = "".join(c for c in string.printable if c not in "\x0b\x0c\r")
# A plain chat template in characters the toy tokenizer knows, so chat formatting works on it too.
TOY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(ValueError):
    """A model that is neither a local directory nor loadable from the hub (or its cache)."""


# A random model of a real model's shape: Qwen2.5-0.5B's sizes on the Llama architecture (494 M
# parameters; no attention biases), with the character tokenizer padded to Qwen's 151,936 tokens.
QWEN_05B_SHAPE = ToyModelSpec(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                              intermediate_size=4864, max_positions=2048, vocab_size=151936)


def resolve(name_or_path: str) -> tuple[str, bool]:
    """(what to pass to from_pretrained, whether to load from local files only).

    A local directory must hold a config.json. Anything else must look like a hub id; offline
    (HF_HUB_OFFLINE=1) it must already be in the local Hugging Face cache.
    """
    problem = model_source.local_problem(name_or_path)
    if problem is not None:
        raise ModelNotFoundError(f"model path {problem}")
    if model_source.is_local(name_or_path):
        return str(Path(name_or_path).expanduser()), True
    if model_source.in_hub_cache(name_or_path):
        return name_or_path, True
    if model_source.offline():
        raise ModelNotFoundError(
            f"model {name_or_path!r} is neither a local directory nor in the Hugging Face cache, and "
            f"HF_HUB_OFFLINE is set: download it first ({model_source.download_hint(name_or_path)}) "
            "or pass a local path")
    return name_or_path, False


# What a causal LM needs from a hub repository (no optimizer states, no other formats' weights).
FETCH_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")


def fetch(name_or_path: str) -> str:
    """Make a model loadable without the network, and say where it lives.

    A local directory is only checked. A hub id is downloaded into the Hugging Face cache, so that
    compute nodes without internet (HF_HUB_OFFLINE=1) find it there. Either way its tokenizer is
    loaded once, so that a wrong model fails here and not in every training job.
    """
    source, _ = resolve(name_or_path)
    if not model_source.is_local(name_or_path) and not model_source.offline():
        from huggingface_hub import snapshot_download

        try:
            source = snapshot_download(name_or_path, allow_patterns=list(FETCH_PATTERNS))
        except Exception as error:  # network, authentication, no such repository: many exception types
            raise ModelNotFoundError(f"could not download {name_or_path!r}: {error}") from None
    load_tokenizer(name_or_path)
    return source


def load_tokenizer(name_or_path: str):
    """The tokenizer of a model, with a pad token (the EOS token when it has none)."""
    from transformers import AutoTokenizer

    source, local_only = resolve(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    except (OSError, ValueError) as error:  # ValueError: a directory without tokenizer files
        raise ModelNotFoundError(f"could not load the tokenizer of {name_or_path!r}: {error}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu"):
    """A causal LM in `dtype` ("float32", "bfloat16", "float16" or "auto") on `device`."""
    from transformers import AutoModelForCausalLM

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"model.dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    source, local_only = resolve(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype="auto" if dtype == "auto" else DTYPES[dtype], local_files_only=local_only)
    except OSError as error:
        raise ModelNotFoundError(f"could not load model {name_or_path!r}: {error}") from None
    return model.to(resolve_device(device))


def checkpoint_format(lm, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` (by the names of `lm`'s modules) as a checkpoint holds them, one tensor at a time.

    transformers 5 keeps some weights differently in memory than on disk: a mixture of experts'
    per-expert matrices are fused into one tensor per layer, for example. A loader of checkpoints
    (vLLM's) knows the disk's names only, so each tensor goes through the reverse of the
    conversion that loaded it, as save_pretrained does. Identity for a model loaded as stored."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 loads every model as stored
        yield from weights
        return
    for name, tensor in weights:
        yield from revert_weight_conversion(lm, {name: tensor}).items()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device: {device!r} asked for, but no CUDA GPU is available")
    return torch.device(device)


def format_prompt(tokenizer, text: str, chat: bool, system: str | None = None) -> str:
    """`text` as the model sees it: as is, or through the tokenizer's chat template."""
    if not chat:
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("model.chat_template is on, but the tokenizer has no chat template")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """A `format_prompt` result as token ids. A chat template writes the model's special tokens itself
    (a BOS where the model has one), so the tokenizer adds none to it; plain text gets what the
    tokenizer adds (a BOS for Llama-style tokenizers)."""
    return tokenizer(text, add_special_tokens=not chat)["input_ids"]


def build_toy_tokenizer(vocab_size: int = 0):
    """A character-level PreTrainedTokenizerFast: one token per printable ASCII character, then
    unused `<extra_i>` tokens up to `vocab_size` (if larger)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = (*TOY_SPECIAL_TOKENS, *TOY_CHARACTERS)
    tokens += tuple(f"<extra_{i}>" for i in range(vocab_size - len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False, model_max_length=10**6)
    tokenizer.chat_template = TOY_CHAT_TEMPLATE
    return tokenizer


def build_toy_model(out_dir: Path, spec: ToyModelSpec = ToyModelSpec()) -> Path:
    """Write a randomly initialised toy Llama and its tokenizer to `out_dir` (atomically)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_toy_tokenizer(spec.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads or spec.num_heads, max_position_embeddings=spec.max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=spec.tie_embeddings)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    save_pretrained_atomic(out_dir, model, tokenizer, extra={"klstudy_toy_spec.json": asdict(spec)})
    log.info("toy model (%d parameters) written to %s", sum(p.numel() for p in model.parameters()), out_dir)
    return out_dir


def save_pretrained_atomic(out_dir: Path, model, tokenizer, extra: dict[str, object] | None = None,
                           state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """save_pretrained (of `state_dict` when given: a sharded model's whole weights) into a temporary
    sibling, then rename: `out_dir` is whole or absent."""
    import json

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    for name, content in (extra or {}).items():
        (tmp / name).write_text(json.dumps(content, indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
