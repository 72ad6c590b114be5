"""Peak memory of per-token log-probs with their gradients: the naive [N, V] computation against the
chunked one (trainer/model/chunked_logprobs.py), on a realistic vocabulary and hidden size, on CPU. With
`--quantity full-kl`, the same for the exact next-token KL between the policy and a frozen reference
(estimator full, trainer/objective/full_kl.py), whose naive side holds both models' [N, V] logits.

Each side runs in its own child process: it allocates the hidden states [N, H] and the output layer
[V, H] (both requiring gradients), records its resident memory, runs forward and backward, and
reports its peak resident memory (VmHWM) above that baseline: the memory the log-probs themselves
need, gradient buffers included. The last line is
    memory_ratio=<lean / naive>

    python benchmarks/logprob_memory.py [--quantity logprobs|full-kl] [--tokens 8192] [--vocab 151936]
                                        [--hidden 3584] [--chunk 1024]

The defaults are Qwen2.5-7B's vocabulary and hidden size. Both sides also allocate the output
layer's gradient (V x H floats, 2 GiB here), which no chunking removes; the naive side's logits
grow with the tokens and the lean side's do not, so the ratio falls as the batch grows. 16,384
tokens would need about 25 GB on the naive side; 8,192 fit a 24 GB machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(side: str, quantity: str, tokens: int, vocab: int, hidden_size: int, chunk: int) -> None:
    import torch

    from trainer.batch import HeadInputs
    from trainer.model.chunked_logprobs import token_logprobs
    from trainer.objective.full_kl import token_kl, token_kl_naive

    def per_token(hidden, weight, targets, ref_hidden, ref_weight):
        if quantity == "full-kl":
            policy, reference = HeadInputs(hidden, weight, None), HeadInputs(ref_hidden, ref_weight, None)
            return token_kl_naive(policy, reference) if side == "naive" else token_kl(policy, reference, 1.0, chunk)
        if side == "naive":
            logits = (hidden @ weight.T).float()
            return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        return token_logprobs(hidden, weight, None, targets, 1.0, chunk)[0]

    def inputs(n: int, v: int):
        hidden = torch.randn(n, hidden_size, requires_grad=True)
        weight = (torch.randn(v, hidden_size) * hidden_size ** -0.5).requires_grad_()
        reference = torch.randn(n, hidden_size), (weight.detach() + 0.01 * torch.randn(v, hidden_size))
        return hidden, weight, torch.randint(v, (n,)), *reference

    torch.manual_seed(0)
    per_token(*inputs(8, 16)).sum().backward()  # warm-up: load the kernels before measuring
    hidden, weight, targets, ref_hidden, ref_weight = inputs(tokens, vocab)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to what is resident now
    baseline = _status("VmRSS")
    start = time.perf_counter()
    logp = per_token(hidden, weight, targets, ref_hidden, ref_weight)
    logp.sum().backward()
    seconds = time.perf_counter() - start
    print(json.dumps({"side": side, "peak_extra": _status("VmHWM") - baseline, "seconds": seconds,
                      "check": float(logp.detach().sum())}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="B x T (default 8192)")
    parser.add_argument("--vocab", type=int, default=151936, help="(default 151936, Qwen2.5)")
    parser.add_argument("--hidden", type=int, default=3584, help="(default 3584, Qwen2.5-7B)")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the lean side (default 1024)")
    parser.add_argument("--quantity", choices=("logprobs", "full-kl"), default="logprobs",
                        help="sampled tokens' log-probs, or the exact KL to a reference over the vocabulary")
    parser.add_argument("--child", choices=("naive", "lean"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.quantity, args.tokens, args.vocab, args.hidden, args.chunk)
        return
    results = {}
    for side in ("lean", "naive"):
        out = subprocess.run([sys.executable, __file__, "--child", side, "--quantity", args.quantity,
                              "--tokens", str(args.tokens), "--vocab",
                              str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk)],
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if out.returncode != 0:
            sys.exit(f"the {side} side failed:\n{out.stderr[-2000:]}")
        results[side] = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 2 ** 30
    print(f"{args.quantity}: N={args.tokens} V={args.vocab} H={args.hidden} float32, chunk {args.chunk}")
    for side, r in results.items():
        print(f"{side:5s}: peak {r['peak_extra'] / gib:6.2f} GiB above its inputs, {r['seconds']:.1f} s, "
              f"sum of the per-token values {r['check']:.4f}")
    print(f"memory_ratio={results['lean']['peak_extra'] / results['naive']['peak_extra']:.3f}")


if __name__ == "__main__":
    main()
