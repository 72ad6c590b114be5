"""Batch whitening of the advantages: the combined per-token return, KL included, standardised over the batch.

Where the KL goes into per-token rewards, the PPO-style libraries' default advantage estimators whiten
the return (the task reward plus the KL rewards, to go or summed) over every response token of the batch:

    A_t = (G_t - mean) / sqrt(var + eps)     mean and var over the response tokens of the whole batch

so the KL term reaches the gradient divided by a batch statistic that itself depends on the KL. Two
variants, read at the commits `trainer.objective.presets` cites:

    sample      the sample variance (Bessel's n / (n - 1)), rsqrt(var + 1e-8); the mean's count is
                n + 1e-8 as in verl's masked_mean (volcengine/verl@b178a3cd verl/utils/torch_functional.py:
                masked_whiten, applied by core_algos.py:261 to GAE and :615 to REINFORCE++). slime's
                distributed_masked_whiten (THUDM/slime@624b824a slime/utils/distributed_utils.py) is the same
                without the 1e-8 in the count: equal to 1e-8 relative
    population  the population variance, rsqrt(max(var, 1e-8)) (OpenRLHF/OpenRLHF@3c3be623
                openrlhf/trainer/ppo_utils/experience_maker.py, compute_advantages_and_returns; NVIDIA-NeMo/
                RL@7ea279ab nemo_rl/algorithms/advantage_estimator.py:262-265, REINFORCE++)

`trainer.objective.advantages` registers the whitening advantages; `trainer.objective.loss.batch_advantages`
whitens after the KL is in. docs/peers.md derives and the audit measures what it does to the KL gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Whitening:
    name: str
    bessel: bool       # the sample variance, n / (n - 1) times the population's
    floor: bool        # rsqrt(max(var, eps)) instead of rsqrt(var + eps)
    count_eps: float   # added to the token count the mean and variance divide by (verl's masked_mean)
    eps: float = 1e-8


SAMPLE = Whitening("sample", bessel=True, floor=False, count_eps=1e-8)
POPULATION = Whitening("population", bessel=False, floor=True, count_eps=0.0)


def whiten(values: Tensor, mask: Tensor, spec: Whitening) -> Tensor:
    """[B, T] `values` ([B] ones are each response's value on its every token) minus their mean over the
    response tokens of `mask`, divided by their standard deviation there, as `spec` computes it."""
    x = values.unsqueeze(-1).expand(mask.shape) if values.dim() == 1 else values
    m = mask.to(x.dtype)
    n = m.sum()
    if spec.bessel and float(n) < 2:
        raise ValueError(f"whitening with the sample variance needs >= 2 response tokens, got {float(n):g}")
    mean = (x * m).sum() / (n + spec.count_eps)
    centred = x - mean
    var = (centred.square() * m).sum() / (n + spec.count_eps)
    if spec.bessel:
        var = var * n / (n - 1)
    scale = var.clamp(min=spec.eps).rsqrt() if spec.floor else (var + spec.eps).rsqrt()
    return centred * scale
