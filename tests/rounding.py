"""How large float rounding can make a difference that is 0 in exact arithmetic, from the size of the
numbers it is computed from. A test compares such a quantity (two computations of one log-prob, a KL
at the reference, an advantage's mean) with one of these bounds, never with a fixed tolerance: a fixed
one is exceeded by the same noise on another machine, or on a larger model.

The bound is the classic one for a sum of `count` terms of size at most `magnitude` (Higham's gamma_n,
to first order): count x eps x magnitude."""

import math

import torch


def rounding(magnitude, count: int = 1, dtype: torch.dtype = torch.float64):
    """count x eps(dtype) x magnitude (a float, or a tensor of each element's magnitude)."""
    return count * torch.finfo(dtype).eps * (magnitude if isinstance(magnitude, torch.Tensor) else float(magnitude))


def assert_equal_to_rounding(got, expected, magnitude, count: int = 1, msg: str = "") -> None:
    """Elementwise |got - expected| <= rounding(magnitude, count), at the eps of the less precise of the
    two (tensors or floats; `magnitude` a float or a tensor of each element's)."""
    got, expected = (x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)
                     for x in (got, expected))
    dtype = got.dtype if torch.finfo(got.dtype).eps > torch.finfo(expected.dtype).eps else expected.dtype
    gap = (got.double() - expected.double()).abs()
    bound = torch.as_tensor(rounding(magnitude, count, dtype), dtype=torch.float64)
    assert bool((gap <= bound).all()), f"{msg} differs by {float(gap.max()):.3g}, more than rounding allows"


@torch.no_grad()
def logit_bound(model) -> float:
    """The largest |logit| a Llama-like model (the toy) can give: its logits are lm_head(RMSNorm(x)), and
    RMSNorm's output has norm at most max|g| sqrt(H), so |z_v| <= max|g| sqrt(H) ||w_v||."""
    gain = model.model.norm.weight
    return float(gain.abs().max()) * gain.numel() ** 0.5 * float(model.lm_head.weight.norm(dim=-1).max())


def logprob_rounding(model, dtype: torch.dtype = torch.float32) -> float:
    """The rounding of one token's log-prob in `dtype` when two passes compute it differently (another batch
    shape, a KV cache, another engine's kernels): numbers of size up to that of a log-prob, z_y - logsumexp(z)
    with |z| <= logit_bound (so at most 2 logit_bound + log V), through sums of H products into each logit."""
    size = 2 * logit_bound(model) + math.log(model.config.vocab_size)
    return rounding(size, model.config.hidden_size, dtype)


def statistic_rounding(model, run: dict) -> float:
    """How large rounding can make a training step's statistic that is 0 in exact arithmetic (the KLs and
    their loss while the policy is its reference, the engine mismatch, a mean advantage, RLOO's
    policy-gradient loss under seq-mean-token-mean), for a run of these overrides (`run_helpers.TOY_RUN`'s
    keys): a response's worth of one log-prob's rounding, and the rounding of a sum over the batch's
    rewards (each in [0, 1])."""
    rows = run["train.prompts_per_step"] * run["train.group_size"]
    return run["rollout.max_new_tokens"] * logprob_rounding(model) + rounding(1.0, rows, torch.float32)


def assert_same_statistic(key: str, a: float, b: float, rel: float, floor: float) -> None:
    """Two runs' values of a statistic: equal to `rel`, or, where either is within the rounding `floor` of
    0, both are (rounding noise differs between machines and batch shapes: it is bounded, never compared)."""
    if min(abs(a), abs(b)) <= floor:
        assert max(abs(a), abs(b)) <= floor, (key, a, b, floor)
    else:
        assert abs(b - a) <= rel * abs(a), (key, a, b, rel)
