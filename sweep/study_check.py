"""A study config checked whole before anything runs: one pass, one line per problem.

`check_study` is what every Snakemake process does with the config: sweep.grid validates it once
(the study schema, then what a schema cannot say). `preflight` is what only the main process
does, before the DAG: the checks against this machine and against a cluster's view of the jobs.
Errors raise StudyError (`<key>: <what is wrong> (<the fix>)`; the Snakefile adds `study config: `);
warnings and notes come back as lines to print.

- A model's local directory must exist and hold a config.json (else its fetch_model job would fail,
  on SLURM after queueing). A hub id cannot be checked offline: a note says so, unless the Hugging
  Face cache has it; with HF_HUB_OFFLINE set, an id missing from the cache is an error.
- A run directory already there holds a run of its grid point's config (else the study says which
  keys changed, and how to retrain it).
- A job's device and its GPUs agree: cuda with no GPU fails on a cluster (an error: asking for
  the GPU costs nothing on this machine, where Snakemake does not count GPUs); GPUs on cpu jobs, or
  more than the one an evaluation uses, sit idle (a warning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sweep.checks import StudyError
from sweep.grid import Study, load_study
from sweep.runs import read_config
from trainer.config import as_saved, differences, from_dict
from trainer.model import model_source
from trainer.run_files import CONFIG

WARNING, NOTE = "warning: study config: ", "note: study config: "


def check_study(config: dict[str, Any], schema_file: Path | None = None) -> Study:
    """The validated study; StudyError names the first bad key."""
    return load_study(config, schema_file)


def preflight(study: Study, rerun: set[str] = frozenset()) -> list[str]:
    """The checks that need this machine (paths, the Hugging Face cache, the results so far) or a
    cluster's view (devices against GPUs): StudyError for what would fail, warning and note lines for
    the rest. `rerun`: points about to be run again from scratch (their directories do not count)."""
    _check_run_directories(study, rerun)
    return [*_model_notes(study), *_device_warnings(study)]


def _check_run_directories(study: Study, rerun: set[str]) -> None:
    """A run directory that holds a run of another config than its grid point's now (the study config
    changed under it): the study would never train it again (finished) or the trainer would refuse it
    (started), so stop here and say how to go on."""
    changed = []
    for run in study.runs:
        saved = study.results / "runs" / run.run_id / CONFIG
        if saved.is_file() and run.run_id not in rerun:
            keys = differences(from_dict(run.config).to_dict(), as_saved(read_config(saved)))
            if keys:
                changed.append((run.run_id, keys))
    if changed:
        (first, keys), more = changed[0], len(changed) - 1
        raise StudyError(f"results: {study.results / 'runs' / first} was trained with another config than the study "
                         f"gives it now ({', '.join(keys)}){f', and {more} more run(s)' if more else ''}: restore the "
                         f"study config, or retrain with --config rerun={first}"
                         f"{',...' if more else ''} (the old outputs are moved to {study.results / 'discarded'}/)")


def _model_notes(study: Study) -> list[str]:
    notes = []
    for name, model in study.models.items():
        if model.prepared:  # built or imported by the prepare step, into the study's results
            continue
        key, path = f"models.{name}.path", model.path
        problem = model_source.local_problem(path)
        if problem is not None:
            raise StudyError(f"{key}: {problem} (give a directory that save_pretrained wrote, relative to the "
                             f"study's directory {Path.cwd()}, or a hub id such as Qwen/Qwen2.5-7B)")
        if model_source.is_local(path) or model_source.in_hub_cache(path):
            continue
        if model_source.offline():
            raise StudyError(f"{key}: {path} is neither a local directory nor in the Hugging Face cache, and "
                             f"HF_HUB_OFFLINE is set, so its fetch_model job cannot download it (download it first: "
                             f"{model_source.download_hint(path)}; or give a local path)")
        notes.append(f"{NOTE}{key}: {path} is not a local directory here, so it is taken as a hub id, which cannot "
                     "be checked offline (its fetch_model job downloads it, and fails there if the hub has no such "
                     "model or it needs a token)")
    return notes


def _device_warnings(study: Study) -> list[str]:
    warnings = []
    for name, model in study.models.items():
        runs = [run for run in study.runs if run.model == name]
        devices = sorted({str(run.config.get("model", {}).get("device", "cpu")) for run in runs})
        device_key = "model.device" if len(devices) > 1 else (
            f"models.{name}.run.model.device" if "device" in model.run.get("model", {}) else "run.model.device")
        for rule in ("train", "evaluate"):
            gpus = study.resources_for(rule, name).get("gpus") or 0
            gpus_key = (f"models.{name}.resources.{rule}.gpus" if "gpus" in model.resources.get(rule, {})
                        else f"resources.{rule}.gpus")
            jobs = f"the {rule} jobs of {name}"
            if gpus == 0 and any(device.startswith("cuda") for device in devices):
                raise StudyError(f"{gpus_key}: 0, but {jobs} run on {'/'.join(devices)} ({device_key}) (on a cluster "
                                 f"they get no GPU and fail as they start: set {gpus_key}: 1"
                                 f"{', or more for training on several GPUs' if rule == 'train' else ''})")
            if gpus and devices == ["cpu"]:
                warnings.append(f"{WARNING}{gpus_key}: {gpus}, but {jobs} run on cpu ({device_key}) (on a cluster "
                                f"each job holds {_gpus(gpus)} it never uses: set {device_key}: cuda, or "
                                f"{gpus_key}: 0)")
            elif rule == "evaluate" and gpus > 1:
                warnings.append(f"{WARNING}{gpus_key}: {gpus}, but an evaluation uses one device (on a cluster "
                                f"each of {jobs} holds {_gpus(gpus - 1)} it never uses: set {gpus_key}: 1)")
    return warnings


def _gpus(count: int) -> str:
    return f"{count} GPU{'s' * (count != 1)}"
