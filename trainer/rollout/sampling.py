"""Token sampling on the model's device: one seeded generator per prompt, no host copy of [B, V].

`torch.multinomial(p, 1, generator=g)` draws by the exponential race: argmax over the vocabulary of
p / q with q ~ Exp(1) drawn from g. On a GPU it also reads its input back to the host three times to
check it, which is a synchronisation per prompt per token. `RowSampler` runs the same race without
the checks, each prompt's rows drawing q from the prompt's own generator on the device, so that on
the CPU it draws exactly the tokens that `torch.multinomial` draws from the same generators.
"""

from __future__ import annotations

from typing import Sequence

import torch


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from: logits / temperature, then nucleus (float32, or
    float64 for float64 logits: the exact audit samples with it too)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits if temperature == 1.0 else logits / temperature  # x / 1 is x: one pass less
    logp = torch.log_softmax(logits, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()  # mass strictly before each token
    sorted_logp = sorted_logp.masked_fill(before >= top_p, float("-inf"))  # the top token always stays
    kept = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
    return torch.log_softmax(kept, dim=-1)


class RowSampler:
    """Draws one token per row from [B, V] log-probabilities; rows i*n .. i*n+n-1 belong to prompt i,
    whose generator (on `device`, seeded with seeds[i]) alone decides their draws."""

    def __init__(self, seeds: Sequence[int], n: int, device: torch.device) -> None:
        self.n = n
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def draw(self, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled token ids [B], their log-probs [B]), both on logp's device."""
        probs = logp.exp()
        race = torch.empty_like(probs)
        for i, generator in enumerate(self.generators):
            race[i * self.n:(i + 1) * self.n].exponential_(generator=generator)
        sampled = torch.div(probs, race, out=race).argmax(dim=-1, keepdim=True)
        return sampled.squeeze(-1), logp.gather(-1, sampled).squeeze(-1)
