"""klstudy's study DAG: prepare -> train (one job per grid point) -> evaluate -> track -> report.

The study config (default workflow/config/toy.yaml; another with --configfile) is checked whole
before any job starts (sweep.study_check): by sweep.grid, which also validates every run's trainer
config, then by workflow/config/schema.yaml, then against this machine (model paths, devices against
GPUs); each error is one line that names the key. A dry run (-n) also prints the plan (sweep.plan):
each job's resources and sbatch options, and where each run starts. Every rule calls a package CLI,
so each job is a command a person can run by hand. The run directories are the state: re-running
the same command finishes only what is missing, and a training job resumes from its newest
checkpoint.
"""

import json
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.utils import min_version

from sweep import study_lock
from sweep.grid import StudyError
from sweep.plan import plan
from sweep.study_check import check_study, preflight
from trainer.launch import train_command

min_version("9.0")


# The toy study unless --configfile names another (Snakemake would otherwise merge the two).
if not workflow.config_settings.configfiles:

    configfile: "workflow/config/toy.yaml"


try:
    STUDY = check_study(config, Path(workflow.basedir) / "workflow" / "config" / "schema.yaml")
    NOTES = preflight(STUDY) if workflow.is_main_process else []
except StudyError as error:
    raise WorkflowError(f"study config: {error}") from None
for line in NOTES:
    print(line, file=sys.stderr)
if workflow.is_main_process and workflow.output_settings.dryrun:
    print("\n".join(plan(STUDY, sys.argv, os.environ)))

# A lock left by a snakemake killed hard is released here, before Snakemake locks (sweep.study_lock).
if workflow.is_main_process:
    try:
        released = study_lock.check(sys.argv, study_lock.unlock_command(
            workflow.main_snakefile, Path.cwd(), workflow.config_settings.configfiles))
    except study_lock.StudyLocked as error:
        raise WorkflowError(str(error)) from None
    if released:
        print(released, file=sys.stderr)


onstart:
    study_lock.claim(sys.argv)
    open_live_tracking()  # workflow/rules/train.smk


onsuccess:
    study_lock.release()
    tracked = RESULTS / "tracking" / f"{STUDY.name}.json"
    if tracked.is_file():  # where to look: the MLflow page that compares the study's runs
        print(f"MLflow, the study's runs: {json.loads(tracked.read_text()).get('runs_page', '?')}", file=sys.stderr)


onerror:
    study_lock.release()


PY = sys.executable  # the interpreter Snakemake runs in, so jobs see the same environment
RESULTS = STUDY.results
LOGS = RESULTS / "logs"
RUN_IDS = [run.run_id for run in STUDY.runs]


wildcard_constraints:
    run="[^/]+",
    suite="[^/]+",
    model="[^/]+",
    name="[^/]+",
    step="[0-9]+",


def _per_model(rule, key):
    """Whether some model sets its own value of a rule's resource (then it is looked up per job)."""
    return any(key in model.resources.get(rule, {}) for model in STUDY.models.values())


def _resource(rule, key, per_model):
    if not (per_model and _per_model(rule, key)):
        return STUDY.resources[rule].get(key)  # a plain value: cheaper for Snakemake than a function
    return lambda wildcards: STUDY.resources_for(rule, STUDY.run(wildcards.run).model).get(key)


def rule_resources(rule, per_model=False):
    """A rule's resources from the study config (`gpus` is Snakemake's `gpu`; `cpus` are its threads)."""
    keys = set(STUDY.resources[rule])
    if per_model:
        keys |= {key for model in STUDY.models.values() for key in model.resources.get(rule, {})}
    return {("gpu" if key == "gpus" else key): _resource(rule, key, per_model) for key in sorted(keys)
            if key != "cpus"}


def rule_threads(rule, per_model=False):
    return _resource(rule, "cpus", per_model)


def model_resources(rule, model):
    """A rule's resources for a job of one model's grid points (a bundled job: no wildcards)."""
    values = STUDY.resources_for(rule, model)
    return {("gpu" if key == "gpus" else key): value for key, value in sorted(values.items()) if key != "cpus"}


include: "workflow/rules/prepare.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output,
