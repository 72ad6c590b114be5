"""How far bf16 autocast moves the gradient of the lean log-probs and of the exact KL from float32's,
next to the naive [N, V] computation under the same autocast (docs/mixed_precision.md).

The case is the one where bf16 logits hurt most: confident tokens. N positions whose hidden state
points at one vocabulary entry (top logits near 17, median top probability about 0.94), targets
sampled from each position's distribution, random advantages as the upstream gradient. For the
full-vocabulary KL the reference's output layer is the policy's, perturbed (`--ref-shift`: 0.02 is a
policy still near its reference, 0.5 one far from it). Each line: the relative error of the output
layer's and the hidden states' gradients against float32, and the cosine of the former.

    python benchmarks/mixed_precision_gradient.py [--tokens 512] [--vocab 8000] [--hidden 64]

Deterministic (seeded); no timing, so one run is the measurement.
"""

from __future__ import annotations

import argparse

import torch

from trainer.batch import HeadInputs
from trainer.model.chunked_logprobs import token_logprobs
from trainer.objective.full_kl import token_kl, token_kl_naive


def confident_case(tokens: int, vocab: int, hidden_size: int, top: float = 17.0, spread: float = 2.5, seed: int = 0):
    """Hidden states [N, H], output layer [V, H], sampled targets [N] and advantages [N]."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5
    favourite = weight[torch.randint(vocab, (tokens,), generator=gen)]
    hidden = top * favourite / favourite.norm(dim=-1, keepdim=True) + spread * torch.randn(tokens, hidden_size,
                                                                                           generator=gen)
    probs = torch.softmax(hidden @ weight.T, dim=-1)
    targets = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return hidden, weight, targets, torch.randn(tokens, generator=gen), probs


def gradients(per_token, hidden: torch.Tensor, weight: torch.Tensor, advantages: torch.Tensor, bf16: bool):
    """d sum(A * per_token) / d (weight, hidden), computed under bf16 autocast or not."""
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        values = per_token(hidden, weight)
    (values.float() * advantages).sum().backward()
    return weight.grad, hidden.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=128)
    args = parser.parse_args()
    hidden, weight, targets, advantages, probs = confident_case(args.tokens, args.vocab, args.hidden)
    print(f"{args.tokens} positions, vocabulary {args.vocab}, hidden {args.hidden}: median top logit "
          f"{float((hidden @ weight.T).max(-1).values.median()):.1f}, median top probability "
          f"{float(probs.max(-1).values.median()):.3f}\n")

    def logprobs(chunked: bool):
        def per_token(h, w):
            if chunked:
                return token_logprobs(h, w, None, targets, chunk=args.chunk)[0]
            return torch.log_softmax((h @ w.T).float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        return per_token

    def full_kl(chunked: bool, shift: float):
        gen = torch.Generator().manual_seed(1)
        reference = HeadInputs(hidden, weight + shift * torch.randn(weight.shape, generator=gen) / args.hidden**0.5,
                               None)

        def per_token(h, w):
            policy = HeadInputs(h, w, None)
            return token_kl(policy, reference, chunk=args.chunk) if chunked else token_kl_naive(policy, reference)
        return per_token

    quantities = {"log-probs": logprobs}
    quantities.update({f"full KL, reference shift {s}": (lambda c, s=s: full_kl(c, s)) for s in (0.02, 0.5)})
    print("| quantity | path | rel. error, output layer | cosine, output layer | rel. error, hidden states |")
    print("|---|---|---:|---:|---:|")
    for name, make in quantities.items():
        exact = gradients(make(False), hidden, weight, advantages, bf16=False)
        for path, chunked in (("naive bf16 autocast", False), ("chunked bf16 autocast", True)):
            got = gradients(make(chunked), hidden, weight, advantages, bf16=True)
            errors = [float((g - e).norm() / e.norm()) for g, e in zip(got, exact, strict=True)]
            cosine = float(torch.nn.functional.cosine_similarity(got[0].flatten(), exact[0].flatten(), dim=0))
            print(f"| {name} | {path} | {errors[0]:.4f} | {cosine:+.3f} | {errors[1]:.4f} |")


if __name__ == "__main__":
    main()
