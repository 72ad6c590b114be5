"""Whether a causal LM's logits are a linear layer over its last hidden states: what the chunked
log-probs and the chunked KL compute them as (`trainer.model.chunked_logprobs`, `trainer.objective.full_kl`).

Many are exactly lm_head(h). Some multiply them by a constant from their config, which the chunked
paths apply by dividing their temperature by it. Others transform them in ways a linear layer cannot
express (soft-capping, a cut vocabulary, a head that is more than one layer), and take the naive path,
the model's own forward. Each model's answer is checked once, on a few tokens, against the logits
its own forward pass gives: a transform this module does not know of is found there, not in a run's
numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# The constant each *ForCausalLM multiplies lm_head's output by, read from its config (transformers
# 5.19's modelling code; by model type, because the same name means opposite things: Granite divides
# by logits_scaling, HyperCLOVAX multiplies by it). MiniCPM3 divides the hidden states, which its
# bias-free lm_head turns into the same factor.
_MULTIPLIERS = {
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                     "granitemoeshared", "minicpm3"), lambda c: 1 / c.logits_scaling),
    "hyperclovax": lambda c: c.logits_scaling,
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass"), lambda c: c.logit_scale),
    "falcon_h1": lambda c: c.lm_head_multiplier,
    "inkling": lambda c: 1 / c.logits_mup_width_multiplier,
}
# Config keys of transforms that are not a constant factor: soft-capping (Gemma 2-4, VaultGemma,
# NanoChat; RecurrentGemma; xLSTM) and Inkling's cut of a padded vocabulary.
_NONLINEAR = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap", "unpadded_vocab_size")


@dataclass(frozen=True)
class LeanHead:
    """logits = scale * layer(last hidden state): the output layer and the constant after it."""

    layer: torch.nn.Linear
    scale: float = 1.0


def lean_head(model) -> LeanHead | None:
    """The model's output layer and logit scale, if its own forward pass computes its logits as
    scale * layer(last hidden state) (checked on a few tokens); else None, with the reason logged."""
    layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(layer, torch.nn.Linear) or getattr(model, "base_model", model) is model:
        return None
    config = model.config
    configs = {id(c): c for c in (config, config.get_text_config())}.values()
    nonlinear = [key for c in configs for key in _NONLINEAR if getattr(c, key, None) is not None]
    if nonlinear:
        log.info("%s transforms its logits (%s): its log-probs take the naive path", type(model).__name__,
                 ", ".join(nonlinear))
        return None
    multiplier = _MULTIPLIERS.get(getattr(config, "model_type", None))
    head = LeanHead(layer, float(multiplier(config)) if multiplier else 1.0)
    if not _reproduces_the_logits(model, head):
        log.warning("%s's logits are not %g x its output layer over its last hidden states: its log-probs take "
                    "the naive path, which holds [tokens, vocabulary] logits at once", type(model).__name__,
                    head.scale)
        return None
    return head


@torch.no_grad()
def _reproduces_the_logits(model, head: LeanHead, tokens: int = 4) -> bool:
    """Whether head.scale * head.layer(last hidden state) equals the model's logits on a few tokens, to
    the rounding of the logits' dtype (in eval mode: dropout would make two passes differ)."""
    ids = torch.arange(min(tokens, head.layer.out_features), device=head.layer.weight.device).unsqueeze(0)
    training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits
        lean = head.layer(model.base_model(input_ids=ids, use_cache=False).last_hidden_state) * head.scale
    finally:
        model.train(training)
    if lean.shape != logits.shape:
        return False
    tolerance = 2 * torch.finfo(logits.dtype).eps * float(logits.abs().max())
    return bool(((lean.double() - logits.double()).abs() <= tolerance).all())
