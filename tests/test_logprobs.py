"""Memory-lean log-probs: the same values and gradients as the naive computation."""

import math
import weakref

import pytest
import torch
from rounding import assert_equal_to_rounding, logprob_rounding
from tiny_models import ragged_batch, tiny_lm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.batch import Rollouts, pack
from trainer.model.chunked_logprobs import ROWS, token_logprobs
from trainer.model.logprobs import completion_logprobs
from trainer.model.models import load_model


def naive(hidden, weight, bias, targets, temperature):
    logits = (hidden @ weight.T + (0 if bias is None else bias)) / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


class LiveBytes(TorchDispatchMode):
    """The bytes of tensor storage that ops made and that are still alive, and their peak: the memory a
    computation holds at once, on any device. A storage made before counts from when an op returns a view
    of it. An op's own scratch, made and freed inside one aten call (logsumexp's), is not seen."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[tuple[str, int]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = (str(storage.device), storage.data_ptr())
                if key[1] and key not in self.seen:  # in-place ops and views return a storage already counted
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: tuple[str, int], size: int) -> None:
        self.seen.discard(key)
        self.live -= size


def test_chunked_log_probs_hold_one_chunk_of_logits_at_a_time():
    """A chunk's [chunk, V] buffers are freed before the next chunk's are made, forward (with the entropy)
    and backward: before, the loop kept the last chunk's logits and probabilities alive, three to four
    chunks of logits at once (an H100's allocator history showed it)."""
    torch.manual_seed(0)
    n, h, v, chunk = 2048, 32, 2048, 512
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(v, (n,))
    logits_chunk = chunk * v * 4
    # a few rows' probabilities and their product with the logits, and logsumexp's scratch (which this cannot see)
    rows = 3 * ROWS * v * 4
    small = 0.1 * logits_chunk  # [N] outputs, a row's log-sum-exp
    inputs = hidden.numel() * 4 + weight.numel() * 4  # counted once viewed (hidden[rows], weight.T)
    with LiveBytes() as forward:
        logp, _ = token_logprobs(hidden, weight, None, targets, 0.7, chunk, with_entropy=True)
    assert 0 < forward.peak - inputs <= logits_chunk + rows + small, (forward.peak - inputs) / logits_chunk
    with LiveBytes() as backward:
        logp.sum().backward()
    gradients = inputs  # made by the backward, alive at its end
    held = backward.peak - gradients - inputs
    assert 0 < held <= logits_chunk + small, held / logits_chunk


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_values_and_gradients_match_the_naive_computation(chunk, with_bias):
    torch.manual_seed(0)
    n, h, v, temperature = 150, 16, 97, 0.7  # a chunk of 1000 rows: its row blocks 64, 64 and a partial 22
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(v, (n,))
    upstream = torch.randn(n, dtype=torch.float64)
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    expected = naive(hidden, weight, bias, targets, temperature)
    grads_expected = torch.autograd.grad((expected * upstream).sum(), inputs)
    got, got_entropy = token_logprobs(hidden, weight, bias, targets, temperature, chunk, with_entropy=True)
    grads_got = torch.autograd.grad((got * upstream).sum(), inputs)

    logits = (hidden @ weight.T + (0 if bias is None else bias)) / temperature
    size = float(logits.abs().max()) + math.log(v)  # of a log-prob: a logit minus a log-sum-exp
    assert_equal_to_rounding(got, expected, size, count=h + v)  # float64: equal to rounding
    for a, b in zip(grads_got, grads_expected, strict=True):  # sums over the rows and the vocabulary
        assert_equal_to_rounding(a, b, float(b.abs().max()), count=n * v)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert_equal_to_rounding(got_entropy, entropy.detach(), size, count=h + v)
    assert not got_entropy.requires_grad
    assert token_logprobs(hidden, weight, bias, targets, temperature, chunk)[1] is None


def test_completion_logprobs_lean_and_naive_agree_on_a_model(toy_model):
    """In float64, so that the two summation orders agree to rounding and any real difference shows."""
    torch.manual_seed(0)
    model = load_model(str(toy_model)).double()
    prompts = [[5, 6, 7], [8, 9]]
    tokens = [[10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]  # two prompts x two samples, ragged
    rollouts = Rollouts(prompt_ids=prompts, n=2, token_ids=tokens, logprobs=[[0.0] * len(t) for t in tokens],
                        texts=[""] * 4, finish_reasons=["length"] * 4)
    batch = pack(rollouts, pad_id=0)
    assert batch.prompt_lengths.tolist() == [3, 3, 2, 2] and batch.rows(slice(2, 4)).prompt_lengths.tolist() == [2, 2]
    results = {}
    for chunk in (0, 3):
        model.zero_grad()
        logp, entropy = completion_logprobs(model, batch, temperature=0.9, with_entropy=True, chunk=chunk)
        (logp * torch.arange(1.0, 5.0)[:, None]).sum().backward()
        results[chunk] = (logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp0, e0, g0), (lp3, e3, g3) = results[0], results[3]
    assert lp0.dtype == lp3.dtype == e0.dtype == torch.float64
    noise = logprob_rounding(model, torch.float64)  # an entropy rounds as a log-prob does
    assert float((lp3 - lp0).abs().max()) <= noise and float((e3 - e0).abs().max()) <= noise
    assert (lp3 == 0).sum() == (batch.completion_mask == 0).sum()  # padding stays 0
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    for name in g0:  # the longest reduction into a parameter's gradient: through the output layer
        assert_equal_to_rounding(g3[name], g0[name], float(g0[name].abs().max()), count=vocab * hidden, msg=name)


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got - exact).norm() / exact.norm())


def test_bf16_gradient_of_confident_tokens_is_as_close_to_float32_as_the_naive_paths(confident_model):
    """Under bf16 autocast (one process) the lean head's backward pass recomputes the logits in bfloat16,
    as its forward pass computed them: in float32 against a bfloat16 log-sum-exp, the gradient 1 - p of
    a confident token was rounding noise (about 100 times the naive path's error on this model)."""
    model, batch = confident_model
    advantages = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def output_layer_gradient(chunk: int, bf16: bool) -> torch.Tensor:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logp, _ = completion_logprobs(model, batch, chunk=chunk)
        (logp * advantages).sum().backward()
        return model.lm_head.weight.grad.clone()

    exact = output_layer_gradient(0, bf16=False)
    naive, lean = (_relative_error(output_layer_gradient(chunk, bf16=True), exact) for chunk in (0, 128))
    assert 0 < naive < 0.1  # bf16 rounding, no more
    assert lean <= 1.1 * naive, (lean, naive)


@pytest.mark.parametrize("config_class,extra", [
    ("GraniteConfig", {"logits_scaling": 8.0}),        # logits / 8
    ("HyperCLOVAXConfig", {"logits_scaling": 4.0}),    # logits x 4: the same key, the other way
    ("CohereConfig", {"logit_scale": 0.25}),
    ("Gemma2Config", {"final_logit_softcapping": 2.0}),  # not linear: the naive path
])
def test_models_that_scale_their_logits_get_the_log_probs_of_their_own_forward_pass(config_class, extra):
    """The lean path's log-probs and gradients are the naive path's (the model's own logits), float64."""
    model, batch = tiny_lm(config_class, **extra), ragged_batch()
    results = []
    for chunk in (0, 3):
        model.zero_grad()
        logp, _ = completion_logprobs(model, batch, temperature=0.9, chunk=chunk)
        logp.sum().backward()
        results.append((logp.detach(), model.lm_head.weight.grad.clone()))
    (naive, naive_grad), (lean, lean_grad) = results
    assert float((lean - naive).abs().max()) <= 1e-12 * float(naive.abs().max()), (lean - naive).abs().max()
    torch.testing.assert_close(lean_grad, naive_grad, rtol=1e-10, atol=1e-12 * float(naive_grad.abs().max()))
