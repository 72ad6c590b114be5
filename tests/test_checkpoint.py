"""Loading a checkpoint: all of it or none of it, under the model's own names."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer import checkpoint
from trainer.model.models import build_toy_tokenizer, load_model


def _perturbed(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def _snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _assert_weights(model, expected):
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def _damage(path, change):
    """Rewrite a checkpoint's weights with `change` and its manifest to match, as a buggy writer would:
    the damage that only loading can find."""
    weights_file = next((path / "model").glob("*.safetensors"))
    weights = load_file(weights_file)
    change(weights)
    save_file(weights, weights_file, metadata={"format": "pt"})
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    manifest["files"] = {name: (path / name).stat().st_size for name in manifest["files"]}
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    assert checkpoint.verify(path) is None


DAMAGE = {
    "missing": lambda weights: weights.pop("model.layers.1.mlp.down_proj.weight"),
    "misshapen": lambda weights: weights.update({"model.norm.weight": torch.ones(3)}),
    "unexpected": lambda weights: weights.update({"model.layers.9.extra.weight": torch.ones(3)}),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_checkpoint_that_does_not_fit_leaves_the_model_untouched(toy_model, tmp_path, damage):
    """The newest checkpoint is damaged: the older one loads, whole. With only the damaged one, the
    run starts from exactly its initial weights (before the fix, the fitting tensors of a damaged
    checkpoint were copied in before the check refused it)."""
    older, newer = _perturbed(load_model(str(toy_model)), 1), _perturbed(load_model(str(toy_model)), 2)
    checkpoint.save(tmp_path / "two", 1, older, {"step": 1}, keep=5)
    checkpoint.save(tmp_path / "two", 2, newer, {"step": 2}, keep=5)
    checkpoint.save(tmp_path / "one", 2, newer, {"step": 2}, keep=5)
    for run in ("two", "one"):
        _damage(tmp_path / run / "step_2", DAMAGE[damage])

    model = load_model(str(toy_model))
    assert checkpoint.load_latest(tmp_path / "two", model) == (1, {"step": 1})
    _assert_weights(model, _snapshot(older))

    model = load_model(str(toy_model))
    initial = _snapshot(model)
    assert checkpoint.load_latest(tmp_path / "one", model) is None
    _assert_weights(model, initial)


def test_a_checkpoint_loads_under_the_models_names_when_stored_under_others(tmp_path):
    """transformers 5 fuses a mixture of experts' per-expert matrices in memory and saves them per
    expert: a checkpoint of such a model must load back exactly (reading the files by their own
    names refused every one, and the run silently started over)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = build_toy_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
                            pad_token_id=tokenizer.pad_token_id, max_position_embeddings=64)
    torch.manual_seed(0)
    trained = _perturbed(Qwen3MoeForCausalLM(config), 3)
    path = checkpoint.save(tmp_path, 4, trained, {"step": 4}, keep=1)
    assert set(load_file(next((path / "model").glob("*.safetensors")))) != set(trained.state_dict())  # stored otherwise

    torch.manual_seed(1)
    model = Qwen3MoeForCausalLM(config)
    assert checkpoint.load_latest(tmp_path, model) == (4, {"step": 4})
    _assert_weights(model, _snapshot(trained))
