"""A study's config files: one reader and one way to write them on a command line, everywhere.

A study is a config file and override files merged over it in order (`--configfile A B`). Snakemake
keeps only the last of repeated flags, so `--configfile A --configfile B` is the study B alone: every
command klstudy writes (the lock's release, the fetch command in messages) gives one flag with every
file, and klstudy's own commands (`python -m sweep status|fetch`) take both forms.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterable

from sweep.study.checks import StudyError, merge

PLACEHOLDER = "STUDY.yaml"  # where the files are not known (a message's example)


def arguments(configfiles: Iterable[Path | str] | None, absolute: bool = False) -> list[str]:
    """`--configfile A B ...` as one flag, the form Snakemake and klstudy read; `absolute`: resolved paths,
    for a command that may run from another directory."""
    paths = [str(Path(path).resolve()) if absolute else str(path) for path in configfiles or []]
    return ["--configfile", *(paths or [PLACEHOLDER])]


def add_option(parser: argparse.ArgumentParser, required: bool = False, default: Path | None = None) -> None:
    """The `--configfile` option of klstudy's commands: the files in order, given after one flag or after
    several (both mean the whole list, where Snakemake would keep only the last flag's). The caller puts
    `default` in place of no files (argparse would extend a default list with the files given)."""
    said = f" (default {default})" if default else ""
    parser.add_argument("--configfile", type=Path, nargs="+", action="extend", metavar="FILE", required=required,
                        help=f"the study config, and override files merged over it in order, as given to snakemake"
                             f"{said}")


def read(configfiles: Iterable[Path]) -> dict[str, Any]:
    """The study config these files make, merged in order as Snakemake merges them."""
    import yaml

    config: dict[str, Any] = {}
    for path in configfiles:
        path = Path(path)
        if not path.is_file():
            raise StudyError(f"--configfile {path}: no such file (the study config you give snakemake)")
        config = merge(config, yaml.safe_load(path.read_text()) or {})
    return config
