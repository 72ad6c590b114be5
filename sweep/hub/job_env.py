"""The environment of every compute job: the hub out of reach, and no hub token.

The submitting node fetches what the study needs first (sweep.hub.fetch); after that the main Snakemake
process switches its own environment to this one, which every job inherits (the local executor
spawns jobs from it, and sbatch exports it to SLURM jobs). A job that still reaches for the hub then
fails loudly at a closed port instead of downloading, and a gated model's token stays on the
submitting node: it is in no job's environment, and the token file is not read either.
"""

from __future__ import annotations

from typing import MutableMapping

# A port where nothing listens: any request fails at once, with the address in the error.
CLOSED_ENDPOINT = "http://127.0.0.1:9"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_ENDPOINT": CLOSED_ENDPOINT,
           "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "HF_TOKEN_PATH": "/dev/null"}
TOKENS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_TOKEN")


def make_offline(environ: MutableMapping[str, str]) -> None:
    """`environ` as a compute job's: offline settings in, tokens out."""
    for name in TOKENS:
        environ.pop(name, None)
    environ.update(OFFLINE)
