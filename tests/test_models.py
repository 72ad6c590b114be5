"""Loading models (local directory, offline hub cache) and the toy model."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.model.models import ModelNotFoundError, format_prompt, load_model, load_tokenizer, resolve


def test_toy_model_loads_with_the_auto_classes(toy_model):
    tokenizer = AutoTokenizer.from_pretrained(toy_model)
    model = AutoModelForCausalLM.from_pretrained(toy_model)
    text = "Q: 12 + 7 = ?\n  A: 19"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text  # spaces and newlines survive
    assert model.config.vocab_size == len(tokenizer)
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tokenizer))


def test_chat_template_on_and_off(toy_model):
    tokenizer = load_tokenizer(str(toy_model))
    assert format_prompt(tokenizer, "1+1=", chat=False) == "1+1="
    chat = format_prompt(tokenizer, "1+1=", chat=True)
    assert chat == "<|user|>\n1+1=\n<|assistant|>\n"
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="model.chat_template is on, but the tokenizer has no chat template"):
        format_prompt(tokenizer, "1+1=", chat=True)


def test_dtype_and_device_options(toy_model):
    model = load_model(str(toy_model), dtype="bfloat16", device="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model.dtype: 'float8'"):
        load_model(str(toy_model), dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is available"):
            load_model(str(toy_model), device="cuda")


def test_missing_models_give_one_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve(str(tmp_path / "nowhere" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve(str(tmp_path / "empty"))


def _run_offline(code: str, cache) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent / "hf_home"))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_hub_ids_load_offline_from_the_local_cache(toy_model, tmp_path):
    """A hub id resolves from the Hugging Face cache layout with HF_HUB_OFFLINE=1; a missing one fails."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--klstudy--toy" / "snapshots" / ("0" * 40)
    shutil.copytree(toy_model, snapshot)
    (cache / "models--klstudy--toy" / "refs").mkdir(parents=True)
    (cache / "models--klstudy--toy" / "refs" / "main").write_text("0" * 40)
    ok = _run_offline("from trainer.model.models import load_model, load_tokenizer\n"
                      "m = load_model('klstudy/toy'); t = load_tokenizer('klstudy/toy')\n"
                      "print(type(m).__name__, len(t))", cache)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["LlamaForCausalLM", str(len(load_tokenizer(str(toy_model))))]
    missing = _run_offline("from trainer.model.models import resolve\nresolve('klstudy/absent')", cache)
    assert missing.returncode != 0
    assert "neither a local directory nor in the Hugging Face cache, and HF_HUB_OFFLINE is set" in missing.stderr
    assert "download it first (hf download klstudy/absent)" in missing.stderr  # huggingface_hub's CLI is `hf`


def test_sft_with_ready_checks_its_model_and_writes_fetch_models_marker(toy_model, tmp_path):
    """A study's build_model job in one process: `sft --ready` checks the model it wrote as fetch-model does
    and writes the same marker; without --ready, none."""
    from run_helpers import trainer_in_process

    out, ready = tmp_path / "toy-sft", tmp_path / "models" / "toy-sft.ready"
    done = trainer_in_process("sft", "--model", str(toy_model), "--out", str(out), "--steps", "1", "--batch-size",
                              "4", "--option", "max_operand=9", "--ready", str(ready))
    assert done.returncode == 0, done.stderr
    assert json.loads(ready.read_text()) == {"model": str(out), "location": str(out)}
    again = trainer_in_process("sft", "--model", str(toy_model), "--out", str(tmp_path / "plain"), "--steps", "1",
                               "--batch-size", "4", "--option", "max_operand=9")
    assert again.returncode == 0 and (tmp_path / "plain" / "config.json").is_file()
    assert sorted(p.name for p in ready.parent.iterdir()) == ["toy-sft.ready"]


def test_fetch_model_checks_local_and_cached_models(toy_model, tmp_path):
    """`trainer fetch-model` (the study's prepare step): a local directory or a cached hub id gives its
    marker; a missing model fails with the resolver's message and writes none."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--klstudy--toy" / "snapshots" / ("0" * 40)
    shutil.copytree(toy_model, snapshot)
    (cache / "models--klstudy--toy" / "refs").mkdir(parents=True)
    (cache / "models--klstudy--toy" / "refs" / "main").write_text("0" * 40)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf_home"))

    def fetch(model: str, ready: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainer", "fetch-model", "--model", model, "--ready",
                               str(tmp_path / ready)], capture_output=True, text=True, env=env, timeout=120)

    assert fetch(str(toy_model), "local.ready").returncode == 0
    assert json.loads((tmp_path / "local.ready").read_text()) == {"model": str(toy_model), "location": str(toy_model)}
    assert fetch("klstudy/toy", "hub.ready").returncode == 0
    assert json.loads((tmp_path / "hub.ready").read_text())["model"] == "klstudy/toy"
    missing = fetch("klstudy/absent", "absent.ready")
    assert missing.returncode == 2 and "HF_HUB_OFFLINE is set" in missing.stderr
    assert not (tmp_path / "absent.ready").exists()
