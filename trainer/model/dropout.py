"""The policy without dropout: train mode's semantics (gradient checkpointing, a mixture of experts'
training behaviour) with none of its noise, so that every pass of the policy (the loss, the sampler's
log-probs, the measured KL) is a function of its weights alone.

With dropout on, the policy's log-probs of its own samples are random: the on-policy ratio is not 1,
and the KL of a policy equal to its reference is not 0 (a step-0 k1 sum of -0.02 on a Llama with
attention_dropout 0.1). verl computes its log-probs in eval mode; OpenRLHF makes its experience in
eval mode; TRL sets every torch.nn.Dropout to 0, which misses the attention dropout that Llama-like
models apply as a float (`attention_dropout`, passed to the attention kernel in train mode).
Here every dropout rate is set to 0 where a model keeps it: torch.nn.Dropout modules, float attributes
of modules, and the config (Falcon, Gemma, GPT-J read theirs at every forward), and likewise layer
drop and router jitter. A pass in train mode is then checked to give the same logits twice.
"""

from __future__ import annotations

import logging
import re

import torch

log = logging.getLogger(__name__)

_RATE = re.compile(r"drop|jitter", re.IGNORECASE)  # attention_dropout, resid_pdrop, layerdrop, router_jitter_noise


class StochasticModelError(RuntimeError):
    """A model whose forward pass in train mode stays random with every dropout rate at 0."""


def _is_rate(key: str, value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and bool(_RATE.search(key))


def _configs(config) -> list:
    """A model config and every config nested in it (a multimodal model's text config, ...)."""
    found, stack = [], [config]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(v for v in vars(current).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    return found


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout rate of `model` to 0 (and layer drop and router jitter), keep its mode, and
    check that two passes in train mode give the same logits; the names of the rates that were not 0
    (the config's too: a saved model's config records the dropout it was trained with)."""
    changed = set()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            changed.add(type(module).__name__)
        for key, value in list(vars(module).items()):
            if _is_rate(key, value):
                setattr(module, key, type(value)(0))
                changed.add(key)
    for config in _configs(getattr(model, "config", None)) if hasattr(model, "config") else []:
        for key, value in list(vars(config).items()):
            if _is_rate(key, value):
                setattr(config, key, type(value)(0))
                changed.add(f"config.{key}")
    if changed:
        log.info("dropout off in %s: %s", type(model).__name__, ", ".join(sorted(changed)))
    _check_train_mode_is_deterministic(model)
    return sorted(changed)


@torch.no_grad()
def _check_train_mode_is_deterministic(model: torch.nn.Module, tokens: int = 8) -> None:
    """Two passes in train mode over a few tokens, from two different random states (the run's own
    random state left as it was), must give the same logits, to the rounding of their dtype."""
    parameter = next(model.parameters())
    vocabulary = model.get_input_embeddings().weight.shape[0]
    ids = torch.arange(min(tokens, vocabulary), device=parameter.device).unsqueeze(0)
    training = model.training
    model.train()
    devices = [parameter.device] if parameter.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            passes = []
            for seed in (1, 2):
                torch.manual_seed(seed)
                passes.append(model(input_ids=ids, use_cache=False).logits)
    finally:
        model.train(training)
    first, second = passes
    gap = float((first.double() - second.double()).abs().max())
    if gap > 8 * torch.finfo(first.dtype).eps * float(first.abs().max()):  # more than a GPU's reduction order
        raise StochasticModelError(
            f"{type(model).__name__} computes different logits in two passes in train mode (by up to {gap:.3g}) "
            "with every dropout rate klstudy knows of at 0: its log-probs would be random, and the on-policy "
            "ratio and the KL to its reference with them; find the random part of its forward and turn it off")
