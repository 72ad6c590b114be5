"""A study config checked whole before anything runs: one pass, one line per problem.

`check_study` is what every Snakemake process does with the config: sweep.study.grid validates it once
(the study schema, then what a schema cannot say). `preflight` is what only the main process
does, before the DAG: the checks against this machine and against a cluster's view of the jobs.
Errors raise StudyError (`<key>: <what is wrong> (<the fix>)`; the Snakefile adds `study config: `);
warnings and notes come back as lines to print.

- A model's local directory must exist and hold a config.json (else its fetch_model job would fail,
  on SLURM after queueing). The jobs run offline (sweep.hub.job_env): every hub model and data set they
  read must be in the Hugging Face cache, or be fetched by this run before its first job
  (sweep.hub.fetch); where this node is offline too (HF_HUB_OFFLINE), a missing one is an error that
  names it and the fetch command.
- Training on several nodes starts its processes with srun in the job's SLURM allocation
  (trainer.srun): where the jobs run on this machine (Snakemake's local executor), nodes > 1 for
  training cannot work, and is an error before any job starts (`check_nodes`, from the Snakefile's
  onstart, where the executor is known), never a silent run on one node.
- A training job of several nodes starts one process per GPU as one srun step, each with a CPU at least
  (trainer.launch): a job with fewer CPUs than GPUs per node would ask more CPUs for the step than it
  holds, and srun refuses such a step after the job's wait in the queue (`check_step_cpus`).
- The runs and evaluations already there were made as the study says now (sweep.study.changes: else the study
  says which outputs and keys changed, and the two ways on).
- A job's device and its GPUs agree: cuda with no GPU fails on a cluster (an error: asking for
  the GPU costs nothing on this machine, where Snakemake does not count GPUs); GPUs on cpu jobs, or
  more than the one an evaluation uses, sit idle (a warning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sweep.hub import fetch
from sweep.hub.hub_needs import cached, needs
from sweep.study import changes
from sweep.study.changes import Survey
from sweep.study.checks import StudyError
from sweep.study.grid import Study, load_study
from sweep.study.rerun import Discarded
from trainer.launch import srun_step
from trainer.model import model_source

WARNING, NOTE = "warning: study config: ", "note: study config: "


def check_study(config: dict[str, Any], schema_file: Path | None = None) -> Study:
    """The validated study; StudyError names the first bad key."""
    return load_study(config, schema_file)


def preflight(study: Study, survey: Survey | None = None, discarded: Discarded | None = None,
              configfiles=None) -> list[str]:
    """The checks that need this machine (paths, the Hugging Face cache, the results so far) or a
    cluster's view (devices against GPUs): StudyError for what would fail, warning and note lines for
    the rest. `survey`: the results against the study (sweep.study.changes; read here if not given);
    `discarded`: what is about to be run again from scratch (sweep.study.rerun: it does not count);
    `configfiles`: the study's, for the commands in messages."""
    discarded = discarded or Discarded()
    survey = (survey or changes.survey(study)).without(discarded.runs, discarded.all_evaluations)
    error = survey.error(study, configfiles)
    if error is not None:
        raise error
    _check_model_paths(study)
    check_step_cpus(study)
    return [*_hub_notes(study, configfiles), *_device_warnings(study)]


def check_nodes(study: Study, config: dict[str, Any], jobs_run_here: bool) -> None:
    """nodes > 1 for training where the jobs run on this machine (`jobs_run_here`: Snakemake's local
    executor): the job's processes start with srun in a SLURM allocation, which such a job lacks."""
    if not jobs_run_here:
        return
    trains = "nodes" in ((config.get("resources") or {}).get("train") or {})
    for name, model in study.models.items():
        nodes = study.resources_for("train", name).get("nodes", 1)
        if nodes > 1:
            key = (f"models.{name}.resources.train" if "nodes" in model.resources.get("train", {})
                   else "resources.train" if trains else "resources.default") + ".nodes"
            raise StudyError(f"{key}: {nodes}, but the jobs run on this machine (Snakemake's local executor), and "
                             "training on several nodes starts its processes with srun in a SLURM job: run with "
                             f"--profile profiles/slurm, or set {key}: 1 (and gpus, or tasks on cpu, for more "
                             "processes on this machine)")


def check_step_cpus(study: Study) -> None:
    """A training job's srun step may ask no more CPUs per node than the job holds (`tasks` x `cpus`)."""
    for name, model in study.models.items():
        resources = study.resources_for("train", name)
        nodes, tasks, cpus = resources.get("nodes") or 1, resources.get("tasks") or 1, resources.get("cpus") or 1
        step = srun_step(nodes, resources.get("gpus") or 0, tasks, cpus)
        if step is None or step[0] * step[1] <= tasks * cpus:
            continue
        own = {"cpus", "gpus", "tasks"} & set(model.resources.get("train", {}))
        key = f"models.{name}.resources.train.cpus" if own else "resources.train.cpus"
        raise StudyError(f"{key}: {cpus}, but the train jobs of {name} start {step[0]} processes per node (one per "
                         f"GPU) as one srun step on {nodes} nodes, each with a CPU at least, and hold {tasks * cpus} "
                         f"CPU{'s' * (tasks * cpus != 1)} per node: srun would refuse the step, on SLURM after the "
                         f"job's wait in the queue (set {key}: {-(-step[0] // tasks)} or more)")


def _check_model_paths(study: Study) -> None:
    for name, model in study.models.items():
        problem = None if model.prepared else model_source.local_problem(model.path)
        if problem is not None:
            raise StudyError(f"models.{name}.path: {problem} (give a directory that save_pretrained wrote, relative "
                             f"to the study's directory {Path.cwd()}, or a hub id such as Qwen/Qwen2.5-7B)")


def _hub_notes(study: Study, configfiles) -> list[str]:
    """What the cache lacks: fetched by this run before any job, or an error where this node is offline."""
    missing = [need for need in needs(study) if not cached(need)]
    if missing and model_source.offline():
        first, more = missing[0], len(missing) - 1
        more = f" (and {more} more)" if more else ""
        raise StudyError(f"{first.key}: {first} is not in the Hugging Face cache{more}, "
                         f"and HF_HUB_OFFLINE is set here, so this run cannot fetch it for its offline jobs (fetch "
                         f"on a node with the network: {fetch.command(configfiles)})")
    return [f"{NOTE}{need.key}: {need} is not in the Hugging Face cache yet: this run fetches it on this node "
            "before any job starts (the jobs run offline)" for need in missing]


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
