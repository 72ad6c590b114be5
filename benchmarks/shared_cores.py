"""torch's OpenMP threads on cores that processes share: active waiting (OpenMP's default) against passive.

A job takes its rule's threads (Snakemake sets OMP_NUM_THREADS to them), and jobs side by side can hold
more threads than the machine has cores: hosts of a cluster on one machine (profiles/slurm/local-cluster.sh
up --hosts), a study beside other work, nodes that SLURM oversubscribes. Each configuration here starts
--processes processes of --threads threads each, together, under each wait policy (OMP_WAIT_POLICY unset,
then PASSIVE). Each process holds a randomly initialised model of SmolLM2-135M's sizes (Llama, 30 layers)
and times, released at once with the others, --rounds of: decoding --length new tokens for --rows rows
(many small operations, the worst case for waiting threads), and one training pass (forward and backward)
over --rows sequences of 4 x --length tokens. The table gives each configuration's median seconds over its
processes and rounds, and the ratio of the default policy's time to PASSIVE's.

    python benchmarks/shared_cores.py [--processes 1 2] [--threads 1 2] [--rounds 3] [--rows 4] [--length 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SMOLLM2_SIZES = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                 "tie_word_embeddings": True}


def child(args: argparse.Namespace) -> None:
    """One process: builds the model, says it is ready, waits for the go, and prints its timings as JSON."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SIZES))
    prompt = torch.randint(0, SMOLLM2_SIZES["vocab_size"], (args.rows, args.length))
    sequences = torch.randint(0, SMOLLM2_SIZES["vocab_size"], (args.rows, 4 * args.length))

    def decode() -> None:
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=args.length, min_new_tokens=args.length, do_sample=False,
                           pad_token_id=0)

    def train() -> None:
        model.zero_grad()
        model(sequences, labels=sequences).loss.backward()

    decode(), train()  # the first calls' allocations, outside the timings
    print("ready", flush=True)
    sys.stdin.readline()
    timings = {"decode": [], "train": []}
    for _ in range(args.rounds):
        for name, work in (("decode", decode), ("train", train)):
            started = time.perf_counter()
            work()
            timings[name].append(time.perf_counter() - started)
    print(json.dumps(timings), flush=True)


def measure(processes: int, threads: int, policy: str | None, args: argparse.Namespace) -> dict[str, float]:
    """The median seconds of each kind of work over `processes` processes started together."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **({"OMP_WAIT_POLICY": policy}
                                                                                  if policy else {}))
    command = [sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--rows", str(args.rows),
               "--length", str(args.length)]
    children = [subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(processes)]
    for process in children:
        assert process.stdout.readline().strip() == "ready", "a child failed to start"
    for process in children:
        process.stdin.write("go\n")
        process.stdin.flush()
    found = {"decode": [], "train": []}
    for process in children:
        timings = json.loads(process.stdout.readline())
        for name in found:
            found[name] += timings[name]
        process.wait()
    return {name: statistics.median(values) for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="processes side by side (1 2)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="threads a process (1 2)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds in every process (3)")
    parser.add_argument("--rows", type=int, default=4, help="rows decoded and sequences trained (4)")
    parser.add_argument("--length", type=int, default=16, help="new tokens a row (16); training takes 4x")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    print(f"{os.cpu_count()} CPUs; {args.rows} rows, {args.length} new tokens, a training pass over "
          f"{args.rows} x {4 * args.length} tokens; median seconds of {args.rounds} rounds in every process")
    columns = [f"{work}, {policy}" for work in ("decode", "train") for policy in ("default", "PASSIVE", "ratio")]
    print("| processes x threads | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for processes in args.processes:
        for threads in args.threads:
            default, passive = measure(processes, threads, None, args), measure(processes, threads, "PASSIVE", args)
            cells = [f"{default[k]:.2f} | {passive[k]:.2f} | {default[k] / passive[k]:.2f}" for k in default]
            print(f"| {processes} x {threads} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
