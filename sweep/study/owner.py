"""One results directory, one study: everything a study records (run and evaluation directories, the job
ledger, its prepared models and data, tables, figures, the MLflow database) lives under its `results`, so
a second study there would rebuild the first's reference model, forget its recorded jobs and pool its
tables. The first study to run jobs in a directory claims it (`<results>/study.json`); any other study
there stops before any job, naming both.

A directory from before the claim was recorded is known by its track job's record
(`<results>/tracking/<study>.json`): a directory whose only tracked study is another is that study's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sweep.study.checks import StudyError
from sweep.study.grid import Study

RECORD = "study.json"


def owner(results: Path) -> str | None:
    """The study that owns a results directory, or None (nothing claimed it, and nothing says whose it is)."""
    try:
        name = json.loads((Path(results) / RECORD).read_text()).get("study")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str):
        return name
    tracked = sorted(path.stem for path in (Path(results) / "tracking").glob("*.json"))
    return tracked[0] if len(tracked) == 1 else None


def check(study: Study, claim: bool) -> None:
    """StudyError where another study owns `study.results`; with `claim` (a run that is to run jobs), the
    directory is claimed for `study` if nothing owns it yet."""
    found = owner(study.results)
    if found is not None and found != study.name:
        raise StudyError(f"results: {study.results} holds the results of study {found}, not {study.name}: two studies "
                         f"in one directory would mix their runs, job ledger, models, tables and MLflow database. "
                         f"Give study {study.name} a directory of its own (results: results/{study.name}), or name "
                         f"it {found} if it is that study grown")
    if claim and not (study.results / RECORD).is_file():
        study.results.mkdir(parents=True, exist_ok=True)
        tmp = study.results / f".{RECORD}.{os.getpid()}"
        tmp.write_text(json.dumps({"study": study.name, "claimed": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        os.replace(tmp, study.results / RECORD)
