"""The wheels a GPU machine without network lacks, for CPython 3.12 on manylinux x86_64: each package
the requirements need, breadth-first through their dependencies, skipping what the machine's image
has (benchmarks/gpu_image_packages.txt) and what `--skip` names (vLLM's optional GPU kernels, which it
imports only when a model needs them). Downloaded with no dependencies of their own (pip resolves for
this machine's Python, not the GPU machine's), one version each.

    python benchmarks/gpu_wheels.py --dest DIR 'vllm==0.26.0' [--skip NAME ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
# vLLM 0.26.0's GPU-only extras it imports lazily (video decoding, other kernel libraries), and numba,
# which the image has in another version: left out, its core engine runs without them.
OPTIONAL = ["PyNvVideoCodec", "torchcodec", "tilelang", "nvidia-cutlass-dsl", "quack-kernels", "humming-kernels",
            "tokenspeed-mla", "flashinfer-python", "apache-tvm-ffi", "fastsafetensors", "nvidia-cudnn-frontend",
            "numba", "llvmlite"]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64", "linux_x86_64", "any"]
TARGET = dict(python_version="3.12", python_full_version="3.12.3", platform_machine="x86_64", sys_platform="linux",
              platform_system="Linux", implementation_name="cpython", platform_python_implementation="CPython")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {canonical(line) for line in lines if line and not line.startswith("#")}


def download(requirement: Requirement, dest: Path) -> Path:
    options = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               "-d", str(dest)]
    for platform in PLATFORMS:
        options += ["--platform", platform]
    before = set(dest.glob("*.whl"))
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    spec = f"{requirement.name}{extras}{requirement.specifier}"  # the marker was evaluated for the GPU machine
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *options, spec], check=True)
    name = canonical(requirement.name)
    found = [w for w in dest.glob("*.whl") if canonical(w.name.split("-")[0]) == name]
    if not found:
        raise SystemExit(f"pip downloaded no wheel named {name} for {requirement}")
    return next(iter(set(found) - before), found[0])


def requirements_of(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        meta = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    needed = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        environments = [dict(default_environment(), **TARGET, extra=extra) for extra in ("", *extras)]
        if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
            needed.append(requirement)
    return needed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("requirements", nargs="+")
    parser.add_argument("--dest", type=Path, required=True)
    parser.add_argument("--image", type=Path, default=HERE / "gpu_image_packages.txt")
    parser.add_argument("--skip", action="append", default=list(OPTIONAL))
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    have = image_packages(args.image)
    skip = {canonical(name) for name in args.skip}
    todo = [Requirement(text) for text in args.requirements]
    wanted = {canonical(r.name) for r in todo}
    seen: set[str] = set()
    while todo:
        requirement = todo.pop(0)
        name = canonical(requirement.name)
        if name in seen or name in skip or (name in have and name not in wanted):
            continue
        seen.add(name)
        wheel = download(requirement, args.dest)
        todo += requirements_of(wheel, set(requirement.extras))
        print(wheel.name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
