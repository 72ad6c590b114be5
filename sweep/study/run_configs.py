"""Each grid point's run config as a file its training job reads: `<results>/configs/<run id>.yaml`.

sweep.study.grid resolves and validates every run's config when the study loads; the main Snakemake
process writes the pending runs' configs here before it submits a job, and the job runs
`python -m trainer train --config FILE --out DIR` (or `train-runs --run FILE DIR ...`): the config
travels as the one YAML document it is, not as `section.key=value` strings to parse again.

A file is rewritten only when its content changes, so that its mtime says when the study last
changed that run, and a re-planned study with nothing new leaves every file as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from sweep.study.grid import Study

CONFIGS = "configs"


def config_file(study: Study, run_id: str) -> Path:
    """Where a run's config is written (the training job's --config)."""
    return study.results / CONFIGS / f"{run_id}.yaml"


def text(study: Study, run_id: str) -> str:
    """A run's config as YAML: the keys the study sets (the trainer's defaults fill in the rest)."""
    return yaml.safe_dump(study.run(run_id).config, sort_keys=False, default_flow_style=False)


def write(study: Study, run_ids: list[str]) -> list[Path]:
    """Writes the configs of `run_ids` whose file is missing or holds another config; returns those written."""
    written = []
    for run_id in run_ids:
        path, content = config_file(study, run_id), text(study, run_id)
        if path.is_file() and path.read_text() == content:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(content)
        partial.replace(path)  # atomic: a job never reads half a config
        written.append(path)
    return written
