"""Where klstudy's peak GPU memory goes, in benchmarks/trainer_vs_trl.py's CUDA setup (a random model of
Qwen2.5-0.5B's shape in bfloat16, 16 prompts x 8 completions of up to 64 tokens, gradient checkpointing):
each step's peak, and the blocks alive at the run's peak, grouped by where they were allocated.

It records the CUDA caching allocator's history (torch.cuda.memory._record_memory_history, Python
frames only), replays its allocations and frees to find the moment of the peak, and writes the summary:
the whole history is too large to bring back from a GPU machine.

    python benchmarks/gpu_peak_memory.py [--steps 3] [--out DIR]     # DIR/peak_memory.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def _replay(events: list[dict]):
    """(index, bytes allocated, the allocations alive) after each event of an allocator history: an `alloc`
    holds its block until its `free_requested` (the tensor's release); frees of blocks allocated before the
    history began are not counted."""
    live: dict[int, dict] = {}
    total = 0
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        yield index, total, live


def blocks_at_peak(events: list[dict]) -> tuple[int, int, list[dict]]:
    """(peak bytes, the index of the event that reached it, the allocations alive then) of an allocator
    history, replayed once to find the peak and again up to it."""
    peak, peak_at = max(((total, index) for index, total, _ in _replay(events)), key=lambda pair: pair[0],
                        default=(0, -1))
    alive = next((list(live.values()) for index, _, live in _replay(events) if index == peak_at), [])
    return peak, peak_at, alive


def site(event: dict, ours: tuple[str, ...] = ("/trainer/", "/benchmarks/")) -> str:
    """Where a block was allocated: the innermost library frames (not torch's), then ours."""
    frames = event.get("frames") or []

    def where(chosen: list[dict], count: int) -> str:
        return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in chosen[:count])

    library = [f for f in frames if "site-packages" in f["filename"] and "/torch/" not in f["filename"]]
    return (where(library, 2) + " | " + where([f for f in frames if any(o in f["filename"] for o in ours)], 4)).strip()


def by_site(blocks: list[dict]) -> list[tuple[str, int, int]]:
    """(site, bytes, blocks), largest first."""
    size: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for block in blocks:
        where = site(block)
        size[where] += block["size"]
        count[where] += 1
    return [(where, total, count[where]) for where, total in size.most_common()]


def main() -> int:
    import torch
    import trainer_vs_trl

    from trainer import run as run_package

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    model = trainer_vs_trl.build_model(Path(tempfile.mkdtemp()), "cuda")
    setup = argparse.Namespace(device="cuda", length=64, prompts=16, group=8, steps=args.steps,
                               gradient_checkpointing=True)
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    run_step = run_package.Run.run_step
    mib = 2**20

    def step_with_its_peak(run):
        print(f"before the step: {torch.cuda.memory_allocated() / mib:.1f} MiB allocated", flush=True)
        torch.cuda.reset_peak_memory_stats()
        metrics = run_step(run)
        print(f"the step's peak: {torch.cuda.max_memory_allocated() / mib:.1f} MiB", flush=True)
        return metrics

    run_package.Run.run_step = step_with_its_peak
    trainer_vs_trl.run_klstudy(setup, model)
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    peak, peak_at, alive = blocks_at_peak(events)
    lines = [f"{torch.cuda.get_device_name()}: {len(events)} allocator events, peak {peak / mib:.1f} MiB at "
             f"event {peak_at} (allocated by {site(events[peak_at])})", "MiB | blocks | allocated at"]
    lines += [f"{total / mib:9.1f} | {count:5d} | {where}" for where, total, count in by_site(alive)[:40]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peak_memory.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
