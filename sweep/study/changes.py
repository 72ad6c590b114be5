"""What a study's outputs were made with, against what the study would make now: read before any job (the
Snakefile), by `python -m sweep status`, and by `--config rerun=changed`. Nothing stale is reported and
nothing up to date is redone.

- **A changed run**: its directory's config.yaml differs from the config its grid point gets now (the
  study config changed under it). The study stops before any job and says which keys, and the two ways
  on: restore the config, or run it again (`rerun=changed`, or its id).
- **A changed evaluation**: a finished one whose record (eval.provenance, in its metrics.json) differs in
  what decides what it measures: the evaluate settings, its data's source or content, the run's dtype or
  chat template; or one made before klstudy recorded this. The same stop, the same two ways on. The
  evaluations of a changed run go with it and are not listed apart.
- **A stale evaluation**: a finished one whose model is no longer there: its run is not finished now (its
  directory deleted by hand or discarded) or finished again since (another COMPLETE record). Nothing to
  decide: it is moved aside and redone with its run, and the study says so.

Reading it costs each run's config.yaml, COMPLETE and each finished evaluation's metrics.json: small files,
once per Snakemake (its main process) or status command, never per job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Collection

from eval import provenance
from sweep.runs import read_config
from sweep.study import configfiles, jobs
from sweep.study.checks import StudyError
from sweep.study.evaluations import Expected
from sweep.study.grid import Study
from trainer.config import as_saved, differences, from_dict
from trainer.run_files import CONFIG

# Where a study sets each compared evaluation setting (eval.provenance.COMPARED), for messages.
STUDY_KEYS = {"tasks": "evaluate.suites", "backend": "evaluate.backend", "samples": "evaluate.samples",
              "greedy": "greedy decoding", "temperature": "evaluate.temperature", "top_p": "evaluate.top_p",
              "max_gen_toks": "evaluate.max_gen_toks", "limit": "evaluate.limit",
              "chat_template": "run.model.chat_template", "dtype": "run.model.dtype", "seed": "grid.seeds",
              provenance.NOT_RECORDED: "what made it (not recorded: made before klstudy recorded it)"}


@dataclass(frozen=True)
class Change:
    """An output made otherwise than the study says now: a run id or an evaluation key, and per key what
    made it and what the study gives now."""

    output: str
    keys: dict[str, tuple[Any, Any]]


@dataclass(frozen=True)
class Survey:
    runs: list[Change] = field(default_factory=list)
    evaluations: list[Change] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # evaluation keys whose model is no longer there

    @property
    def changed(self) -> list[str]:
        """The run ids and evaluation keys to run again for the study to hold what its config says."""
        return [change.output for change in self.runs + self.evaluations]

    def without(self, runs: Collection[str], evaluations: Collection[str]) -> Survey:
        """What is still changed once these runs (with their evaluations) and evaluations are run again."""
        gone = lambda key: key in evaluations or key.split("/")[0] in runs  # noqa: E731
        return Survey([change for change in self.runs if change.output not in runs],
                      [change for change in self.evaluations if not gone(change.output)],
                      [key for key in self.stale if not gone(key)])

    def outputs_of(self, run_id: str) -> list[Change]:
        """A grid point's changed outputs: its run, or its evaluations."""
        return [change for change in self.runs + self.evaluations if change.output.split("/")[0] == run_id]

    def error(self, study: Study, files: list | None = None) -> StudyError | None:
        """The stop before any job, or None: what changed, where, and the two ways on."""
        parts = [_summary(what, changes, study) for what, changes in (("run", self.runs),
                                                                      ("evaluation", self.evaluations)) if changes]
        if not parts:
            return None
        status = " ".join(["python -m sweep status", *configfiles.arguments(files)]) if files else \
            "python -m sweep status"
        return StudyError(f"results: {' and '.join(parts)}: restore the study config, or run them again from scratch "
                          f"with --config rerun=changed (the old outputs are moved to {study.results / 'discarded'}/; "
                          f"`{status}` lists them)")


def _summary(what: str, changes: list[Change], study: Study) -> str:
    """`3 runs were made otherwise than the study says now (train.steps: 6 there, 8 now; in results/runs/ID
    and 2 more)`."""
    first = changes[0]
    keys: dict[str, tuple[Any, Any]] = {}
    for change in changes:
        for key, values in change.keys.items():
            keys.setdefault(key, values)
    said = keys_text(keys)
    where = study.results / ("runs" if what == "run" else "eval") / first.output
    more = f" and {len(changes) - 1} more" if len(changes) > 1 else ""
    plural = "s were" if len(changes) > 1 else " was"
    return f"{len(changes)} {what}{plural} made otherwise than the study says now ({said}; in {where}{more})"


def keys_text(keys: dict[str, tuple[Any, Any]]) -> str:
    """`train.steps: 6 there, 8 now; evaluate.samples: 4 there, 2 now`."""
    return "; ".join(key if key == STUDY_KEYS[provenance.NOT_RECORDED] else
                     f"{key}: {_value_text(was)} there, {_value_text(now)} now" for key, (was, now) in keys.items())


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def survey(study: Study) -> Survey:
    """Every output of the study's grid points, compared with what the study would make now."""
    runs = [change for run in study.runs if (change := _run_change(study, run.run_id))]
    changed = {change.output for change in runs}
    expected, evaluations, stale = Expected(study), [], []
    for target in jobs.evaluations(study):
        if target.run in changed:
            continue
        finished, recorded = _recorded(study, target)
        if not finished:
            continue
        now = expected(target)
        if now["model"]["sha256"] is None:  # its run is not finished: the model it scored is gone
            stale.append(target.key)
            continue
        keys = provenance.differences(recorded, now)
        if "model" in keys:
            stale.append(target.key)
        elif keys:
            evaluations.append(Change(target.key, _evaluation_keys(recorded, now, keys)))
    return Survey(runs, evaluations, stale)


def _run_change(study: Study, run_id: str) -> Change | None:
    saved_file = study.results / "runs" / run_id / CONFIG
    if not saved_file.is_file():
        return None
    wanted, saved = from_dict(study.run(run_id).config).to_dict(), as_saved(read_config(saved_file))
    keys = differences(wanted, saved)
    return Change(run_id, {key: (_lookup(saved, key), _lookup(wanted, key)) for key in keys}) if keys else None


def _lookup(config: Any, key: str) -> Any:
    section, name = key.split(".", 1)
    part = config.get(section) if isinstance(config, dict) else None
    return part.get(name) if isinstance(part, dict) else None


def _recorded(study: Study, target: jobs.EvalTarget) -> tuple[bool, dict[str, Any] | None]:
    """Whether the evaluation is finished, and its record (None where it has none, or cannot be read)."""
    try:
        metrics = json.loads(jobs.evaluation_file(study, target).read_text())
    except FileNotFoundError:
        return False, None
    except (OSError, ValueError):
        return True, None  # unreadable: made otherwise, as far as anyone can tell
    return True, metrics.get("provenance") if isinstance(metrics, dict) else None


def _evaluation_keys(recorded: dict[str, Any], now: dict[str, Any], keys: list[str]) -> dict[str, tuple[Any, Any]]:
    """Changed evaluation settings as study keys, each with what made the evaluation and what it would be now."""
    said = {}
    for key in keys:
        if key.startswith("data."):
            task = key.split(".", 1)[1]
            was, is_now = (recorded.get("data") or {}).get(task) or {}, now["data"].get(task) or {}
            same_source = was.get("source") == is_now.get("source")
            said[f"evaluate.data.{task}"] = (("content " + str(was.get("sha256"))[:12]) if same_source
                                             else was.get("source"),
                                             ("content " + str(is_now.get("sha256"))[:12]) if same_source
                                             else is_now.get("source"))
        elif key == provenance.NOT_RECORDED:
            said[STUDY_KEYS[key]] = (None, None)
        else:
            said[STUDY_KEYS[key]] = ((recorded.get("settings") or {}).get(key), now["settings"][key])
    return said
