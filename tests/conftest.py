"""Shared fixtures: a toy model and a warmed-up toy model, built once per test session; a pair of
float64 models a little apart; SmolLM2-135M-Instruct, a real model, imported once into the cache."""

import copy

import pytest
import torch

from trainer.models import ToyModelSpec, build_toy_model, load_model


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory):
    """A randomly initialised character-level toy Llama (a directory)."""
    return build_toy_model(tmp_path_factory.mktemp("models") / "toy", ToyModelSpec())


@pytest.fixture(scope="session")
def untied_toy_model(tmp_path_factory):
    """The toy model with an output layer of its own (not the input embedding)."""
    return build_toy_model(tmp_path_factory.mktemp("models") / "toy-untied", ToyModelSpec(tie_embeddings=False))


@pytest.fixture(scope="session")
def warm_model(toy_model, tmp_path_factory):
    """The toy model after a short supervised warm-up on single-digit arithmetic."""
    from trainer.sft import sft

    out = tmp_path_factory.mktemp("models") / "toy-sft"
    report = sft(str(toy_model), "arithmetic", out, {"max_operand": 9}, steps=150, batch_size=64,
                 eval_problems=64)
    assert report["sampled_reward"] > 0.2, report  # RL starts with a reward clearly above zero
    return out


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct's imported model directory (shared by every test: do not write into it)."""
    from smollm2_required import require_smollm2

    return require_smollm2()


@pytest.fixture
def model_and_perturbed_copy(toy_model):
    """The toy model in float64 and a copy of it whose every weight moved by 0.05 x N(0, 1) (seed 0):
    two models whose next-token distributions differ everywhere, for exact KL checks."""
    torch.manual_seed(0)
    model = load_model(str(toy_model)).double()
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model, moved
