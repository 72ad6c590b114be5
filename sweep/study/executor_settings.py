"""The submitit executor's settings as a Snakemake invocation gives them, for what the plan prints before
the jobs exist: the command line (`--submitit-NAME VALUE` or `=VALUE`; the last one wins, as with
argparse), else the environment (SNAKEMAKE_SUBMITIT_NAME), else the profile's config.yaml
(`--profile DIR` or SNAKEMAKE_PROFILE; key `submitit-NAME`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml


def executor_setting(name: str, argv: list[str], environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(value, where it came from) of the executor's setting `name` (`partition`, `signal-delay`...), or None."""
    option = f"--submitit-{name}"
    found = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"{option}="):
            found = (arg.split("=", 1)[1], option)
        elif arg == option and i + 1 < len(argv):
            found = (argv[i + 1], option)
    if found:
        return found
    variable = f"SNAKEMAKE_SUBMITIT_{name.upper().replace('-', '_')}"
    if environ.get(variable):
        return environ[variable], variable
    config = profile_config(argv, environ)
    if config is not None:
        settings = _read(config)
        if f"submitit-{name}" in settings:
            return str(settings[f"submitit-{name}"]), str(config)
    return None


def profile_config(argv: list[str], environ: Mapping[str, str]) -> Path | None:
    """The profile's config.yaml that Snakemake reads for this invocation, if any."""
    profile = environ.get("SNAKEMAKE_PROFILE")
    for i, arg in enumerate(argv):
        if arg == "--profile" and i + 1 < len(argv):
            profile = argv[i + 1]
        elif arg.startswith("--profile="):
            profile = arg.split("=", 1)[1]
    return Path(profile) / "config.yaml" if profile else None


def _read(config: Path) -> dict[str, Any]:
    settings = yaml.safe_load(config.read_text()) if config.is_file() else None
    return settings if isinstance(settings, dict) else {}
