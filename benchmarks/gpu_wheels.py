"""The wheels a GPU machine without network lacks, for CPython 3.12 on manylinux x86_64: each package
the requirements need, breadth-first through their dependencies, skipping what the machine's image
has (benchmarks/gpu_image_packages.txt) and what `--skip` names (vLLM's optional GPU kernels, which it
imports only when a model needs them). Downloaded with no dependencies of their own, one version each:
the first version asked for, or `--pin`'s. pip's own resolver cannot do this here, since it resolves the
image's packages too (torch's CUDA libraries, which the registry may not hold); the requirements that
the chosen versions leave unmet are printed as conflicts, to be settled with `--pin`.

With `--install SITE` they are then installed into the folder SITE, as pip would for the GPU machine (no
compiled bytecode): a folder that travels as one archive, about half the size of the wheels, and needs no
pip there.

    python benchmarks/gpu_wheels.py --dest DIR 'vllm==0.26.0' [--skip NAME ...] [--pin NAME==VERSION ...]
        [--install SITE]
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
# vLLM 0.26.0's requirements that it imports only for some models or options (video decoding, other
# kernel libraries), and numba, which the image has in another version: left out, its engine ran on an
# H100 without them (docs/benchmarks/gpu.md).
OPTIONAL = ["PyNvVideoCodec", "torchcodec", "tilelang", "nvidia-cutlass-dsl", "quack-kernels", "humming-kernels",
            "tokenspeed-mla", "fastsafetensors", "nvidia-cudnn-frontend", "numba", "llvmlite"]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64", "linux_x86_64", "any"]
TARGET = dict(python_version="3.12", python_full_version="3.12.3", platform_machine="x86_64", sys_platform="linux",
              platform_system="Linux", implementation_name="cpython", platform_python_implementation="CPython")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {canonical(line) for line in lines if line and not line.startswith("#")}


def target_options() -> list[str]:
    """pip's options that choose wheels for the GPU machine rather than this one."""
    options = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for platform in PLATFORMS:
        options += ["--platform", platform]
    return options


def download(requirement: Requirement, dest: Path) -> Path:
    options = [*target_options(), "-d", str(dest)]
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


def conflicts(wheels: dict[str, Path], asked: dict[str, list[tuple[str, Requirement]]]) -> list[str]:
    """Each requirement met by another version than the bundle's (the first asked wins: no backtracking)."""
    found = []
    for name, wheel in wheels.items():
        version = wheel.name.split("-")[1]
        for who, requirement in asked.get(name, []):
            if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
                found.append(f"{who} asks for {requirement.name}{requirement.specifier}, the bundle has {version}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("requirements", nargs="+")
    parser.add_argument("--dest", type=Path, required=True)
    parser.add_argument("--image", type=Path, default=HERE / "gpu_image_packages.txt")
    parser.add_argument("--skip", action="append", default=list(OPTIONAL))
    parser.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION",
                        help="this version, whatever a package asks (a conflict it leaves is printed)")
    parser.add_argument("--install", type=Path, metavar="SITE", help="then install them into this folder")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    have = image_packages(args.image)
    skip = {canonical(name) for name in args.skip}
    pins = {canonical(Requirement(text).name): Requirement(text) for text in args.pin}
    todo = [("the command line", Requirement(text)) for text in args.requirements]
    wanted = {canonical(r.name) for _, r in todo}
    wheels: dict[str, Path] = {}
    extras_done: dict[str, set[str]] = {}
    asked: dict[str, list[tuple[str, Requirement]]] = {}
    while todo:
        who, requirement = todo.pop(0)
        name = canonical(requirement.name)
        if name in skip or (name in have and name not in wanted):
            continue
        asked.setdefault(name, []).append((who, requirement))
        if name not in wheels:
            wheels[name] = download(pins.get(name, requirement), args.dest)
            extras_done[name] = set()
            todo += [(wheels[name].name, r) for r in requirements_of(wheels[name], set(requirement.extras))]
            print(wheels[name].name, flush=True)
        elif not set(requirement.extras) <= extras_done[name]:  # asked again with more extras: their needs too
            todo += [(wheels[name].name, r) for r in requirements_of(wheels[name], set(requirement.extras))]
        extras_done[name] |= set(requirement.extras)
    for line in conflicts(wheels, asked):
        print(f"conflict: {line}", file=sys.stderr)
    if args.install:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-compile", "--no-cache-dir",
                        *target_options(), "--target", str(args.install), *map(str, wheels.values())], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
