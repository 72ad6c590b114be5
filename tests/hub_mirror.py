"""The tree of git repositories that olah's offline mode serves (its `mirrors-path`).

`<root>/models/ORG/NAME` and `<root>/datasets/ORG/NAME`, each a git repository whose branch `main`
holds the repository's files as the hub has them: large files (weights, parquet) as Git LFS pointers
with their objects under `.git/lfs/objects/`, where olah looks for them. No git-lfs is needed: a
pointer is three lines of text.

What is served:
- SmolLM2-135M-Instruct, as klstudy imports it from the registry's GGUF (trainer.model.model_import),
  under its own id, and under the paper's three model ids as stand-ins for a CPU rehearsal of the
  paper study; the stand-in for the gated Llama-3.1-8B-Instruct is served only with a token
  (tests/hub_server.py). One copy of the weights: every repository hard-links the same object.
- The paper's data sets in their real layouts, with generated rows (tests/hub_layouts.py).

The tree is built once into the cache ($KLSTUDY_CACHE, else ~/.cache/klstudy) under a key of what it
is built from, so later sessions find it; commits have fixed dates, so their ids are stable.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from hub_layouts import DATASETS

from trainer.model.model_import import MARKER, cache_dir

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GATED_ID = "meta-llama/Llama-3.1-8B-Instruct"
# The paper's models (workflow/config/paper.yaml), each served as SmolLM2-135M-Instruct.
STAND_INS = ("Qwen/Qwen2.5-7B", GATED_ID, "Qwen/Qwen3-4B-Instruct-2507")
LFS_SUFFIXES = (".safetensors", ".parquet", ".bin", ".gguf")
# Raise when what is built changes: the cache key includes it.
LAYOUT_VERSION = 1
_DATE = "2025-01-01T00:00:00+00:00"
_GIT_ENV = {"GIT_AUTHOR_NAME": "klstudy tests", "GIT_AUTHOR_EMAIL": "tests@klstudy.invalid",
            "GIT_COMMITTER_NAME": "klstudy tests", "GIT_COMMITTER_EMAIL": "tests@klstudy.invalid",
            "GIT_AUTHOR_DATE": _DATE, "GIT_COMMITTER_DATE": _DATE,
            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          env={**os.environ, **_GIT_ENV})
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo} failed: {done.stderr.strip()}")
    return done.stdout.strip()


@functools.cache
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    """The file's SHA-256, computed once for the four model repositories that share the weights."""
    stat = path.stat()
    return _file_sha256(path, stat.st_size, stat.st_mtime_ns)


def _add_lfs_object(repo: Path, source: Path) -> bytes:
    """`source` into the repository's LFS store (a hard link where the file system allows one);
    returns its pointer, the text that git keeps in place of the file."""
    oid, size = _sha256(source), source.stat().st_size
    target = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def write_repo(repo: Path, files: dict[str, bytes | Path], message: str) -> str:
    """A git repository at `repo` whose `main` is one commit of `files` (path -> bytes, or a file to
    take); files with LFS_SUFFIXES go through LFS. Returns the commit id."""
    repo.mkdir(parents=True)
    _git(repo, "init", "--quiet", "--initial-branch=main")
    with tempfile.TemporaryDirectory() as scratch:
        for name, content in sorted(files.items()):
            target = repo / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if name.endswith(LFS_SUFFIXES):
                source = content if isinstance(content, Path) else Path(scratch) / "blob"
                if isinstance(content, bytes):
                    source.write_bytes(content)
                target.write_bytes(_add_lfs_object(repo, source))
                if isinstance(content, bytes):
                    source.unlink()
            else:
                target.write_bytes(content.read_bytes() if isinstance(content, Path) else content)
    _git(repo, "add", "--all")
    _git(repo, "commit", "--quiet", "--no-gpg-sign", "-m", message)
    return _git(repo, "rev-parse", "main")


def _model_card(hub_id: str, source: dict) -> bytes:
    what = ("SmolLM2-135M-Instruct" if hub_id == MODEL_ID
            else f"A stand-in: SmolLM2-135M-Instruct under the id of {hub_id}, for CPU rehearsals of the paper study")
    front = {"library_name": "transformers", "license": "apache-2.0", "language": ["en"],
             "pipeline_tag": "text-generation", "tags": ["klstudy-test-hub"]}
    lines = "".join(f"{key}: {json.dumps(value)}\n" for key, value in front.items())
    return (f"---\n{lines}---\n\n# {hub_id}\n\n{what}, served by klstudy's test hub (tests/hub_server.py). "
            f"Imported by trainer.model.model_import from {source.get('wheel', 'a GGUF file')} "
            "(dequantized to float32).\n").encode()


def model_files(smollm2: Path, hub_id: str) -> dict[str, bytes | Path]:
    """The files of a model repository: the imported model's (without its import marker), a card and
    .gitattributes."""
    source = json.loads((smollm2 / MARKER).read_text()) if (smollm2 / MARKER).is_file() else {}
    files: dict[str, bytes | Path] = {p.name: p for p in sorted(smollm2.iterdir()) if p.is_file() and p.name != MARKER}
    files["README.md"] = _model_card(hub_id, source)
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    return files


def _key(smollm2: Path) -> str:
    import datasets
    import pyarrow

    marker = (smollm2 / MARKER).read_bytes() if (smollm2 / MARKER).is_file() else str(smollm2).encode()
    parts = [str(LAYOUT_VERSION), marker.decode(), datasets.__version__, pyarrow.__version__]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def build(root: Path, smollm2: Path) -> dict[str, str]:
    """The whole tree at `root`; returns {"models/ORG/NAME" or "datasets/ORG/NAME": commit id}."""
    commits = {}
    for hub_id in (MODEL_ID, *STAND_INS):
        commits[f"models/{hub_id}"] = write_repo(root / "models" / hub_id, model_files(smollm2, hub_id),
                                                 f"{hub_id}: SmolLM2-135M-Instruct")
    for hub_id, layout in DATASETS.items():
        commits[f"datasets/{hub_id}"] = write_repo(root / "datasets" / hub_id, layout(),
                                                   f"{hub_id}: generated rows in the real layout")
    (root / "commits.json").write_text(json.dumps(commits, indent=1) + "\n")
    return commits


def mirror_tree(smollm2: Path, cache: Path | None = None) -> Path:
    """The tree for `smollm2` (an imported model directory), from the cache or built into it once."""
    root = (cache or cache_dir()) / "hub" / f"mirror-{_key(smollm2)}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions building it at once: the second finds it built
        if not (root / "commits.json").is_file():
            partial = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}-"))
            build(partial, smollm2)
            shutil.rmtree(root, ignore_errors=True)
            partial.rename(root)
    return root


def commits(root: Path) -> dict[str, str]:
    return json.loads((root / "commits.json").read_text())
