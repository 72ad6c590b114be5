"""klstudy's study DAG: prepare -> train (one job per grid point) -> evaluate -> track -> report.

The study config (default workflow/config/toy.yaml; another with --configfile) is checked whole
before any job starts (sweep.study.study_check): once by sweep.study.grid, against the study schema
workflow/config/schema.yaml (sweep.study.study_schema) and then every run's trainer config, then against
this machine and the results so far (the results directory another study's (sweep.study.owner), model
paths, devices against GPUs, runs and evaluations made otherwise than the study says now
(sweep.study.changes), hub models and data sets missing from the cache where this node is offline); each
error is one line that names the key. Each pending run's config is written to
<results>/configs/<run id>.yaml, which its training job reads (sweep.study.run_configs). A dry run (-n) also
prints the plan (sweep.study.plan): each job's resources and sbatch options, and where each run starts.
Every rule calls a package CLI, so each job is a command a person can run by hand.

Jobs run offline (sweep.hub.job_env): before the first one, this process fetches the study's hub models and
data sets that the cache lacks (sweep.hub.fetch, with this node's network and token), then gives every job
an environment where the hub is out of reach and no token is set.

The run directories are the state (sweep.study.jobs): a finished run (COMPLETE) or evaluation
(metrics.json) is never in a job again, so re-running the same command, after any kill, finishes only
what is missing, and a study that grows (seeds, betas, any axis value) runs only its new points.
`--config rerun=failed`, `rerun=changed` or `rerun=ID[,ID...]` (run ids and evaluation keys) first moves
those outputs aside (sweep.study.rerun), so that they are trained and evaluated again from scratch; so are
evaluations whose model is no longer there (their run was deleted or trained again).
"""

import atexit
import gc
import json
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.utils import min_version

from sweep.hub import fetch, hub_needs, job_env
from sweep.study import changes, jobs, owner, rerun, study_lock
from sweep.study.grid import StudyError
from sweep.study.plan import plan
from sweep.study.study_check import check_nodes, check_study, preflight
from trainer.launch import job_command
from trainer.objective import plugins

min_version("9.0")
# Snakemake's process ends without its last collections walking every object it made (gc.freeze at exit):
# about 0.3 s of the 1.5 s of CPU that a dry run of the quick toy study takes.
atexit.register(gc.freeze)

try:
    plugins.load()  # the objectives packages register (trainer.objective.plugins), before any registry is read
except plugins.PluginError as error:
    raise WorkflowError(str(error)) from None


# The toy study unless --configfile names another (Snakemake would otherwise merge the two).
if not workflow.config_settings.configfiles:

    configfile: "workflow/config/toy.yaml"


RERUN = config.pop("rerun", None)  # --config rerun=...: not a study key
# What only the main process does, and only when it is to run jobs (not a dry run, not --unlock ...).
MAIN = workflow.is_main_process
RUNS_JOBS = MAIN and not workflow.output_settings.dryrun and not study_lock.NO_LOCK_OPTIONS & set(sys.argv)

try:
    STUDY = check_study(config, Path(workflow.basedir) / "workflow" / "config" / "schema.yaml")
except StudyError as error:
    raise WorkflowError(f"study config: {error}") from None

# A lock left by a snakemake killed hard is released here, before Snakemake locks (sweep.study.study_lock).
if MAIN:
    try:
        released = study_lock.check(sys.argv, study_lock.unlock_command(
            workflow.main_snakefile, Path.cwd(), workflow.config_settings.configfiles))
    except study_lock.StudyLocked as error:
        raise WorkflowError(str(error)) from None
    if released:
        print(released, file=sys.stderr)

# What the results hold against what the study says now (sweep.study.changes): stale evaluations and what
# --config rerun=... names are moved aside (sweep.study.rerun); anything else made otherwise stops the study here.
CHECKS = MAIN and "--unlock" not in sys.argv  # releasing a lock reads nothing of the results
DISCARDED = rerun.Discarded()
try:
    NOTES = []
    if CHECKS:
        owner.check(STUDY, claim=RUNS_JOBS)
        SURVEY = changes.survey(STUDY)
        DISCARDED = rerun.discard(STUDY, RERUN, SURVEY, dry_run=not RUNS_JOBS)
        for line in rerun.said(STUDY, DISCARDED, done=RUNS_JOBS, named=RERUN is not None):
            print(line, file=sys.stderr)
        NOTES = preflight(STUDY, SURVEY, DISCARDED, configfiles=workflow.config_settings.configfiles)
except StudyError as error:
    raise WorkflowError(f"study config: {error}") from None
for line in NOTES:
    print(line, file=sys.stderr)

# What is left to do, in jobs: planned (and recorded) by the main process, read back by a job's own.
WORK = (jobs.plan(STUDY, record=RUNS_JOBS, redo_runs=DISCARDED.runs, redo_evaluations=DISCARDED.all_evaluations)
        if MAIN else jobs.recorded(STUDY))
if MAIN and workflow.output_settings.dryrun:
    print("\n".join(plan(STUDY, WORK, sys.argv, os.environ, discarded=DISCARDED.runs)))


def fetch_then_go_offline():
    """The hub models and data sets the cache lacks, fetched here; then this process's environment, which
    every job inherits, made a compute job's (sweep.hub.job_env). A failed fetch stops the study before any job."""
    try:
        fetch.fetch_missing(hub_needs.needs(STUDY), say=lambda line: print(line, file=sys.stderr))
    except fetch.FetchError as error:
        raise WorkflowError(f"fetch: {error}") from None
    job_env.make_offline(os.environ)


def check_where_jobs_run():
    """What only the executor decides: training on several nodes needs jobs in SLURM allocations."""
    try:
        check_nodes(STUDY, config, workflow.executor_plugin.common_settings.local_exec)
    except StudyError as error:
        raise WorkflowError(f"study config: {error}") from None


onstart:
    check_where_jobs_run()
    fetch_then_go_offline()
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


def _resource(rule, key, per_model, run_of=lambda wildcards: wildcards.run):
    if not (per_model and _per_model(rule, key)):
        return STUDY.resources[rule].get(key)  # a plain value: cheaper for Snakemake than a function
    return lambda wildcards: STUDY.resources_for(rule, STUDY.run(run_of(wildcards)).model).get(key)


def rule_resources(rule, per_model=False, run_of=lambda wildcards: wildcards.run):
    """A rule's resources from the study config (`gpus` is Snakemake's `gpu`; `cpus` are its threads);
    `run_of` names a job's run from its wildcards, where a model may set its own."""
    keys = set(STUDY.resources[rule])
    if per_model:
        keys |= {key for model in STUDY.models.values() for key in model.resources.get(rule, {})}
    return {("gpu" if key == "gpus" else key): _resource(rule, key, per_model, run_of) for key in sorted(keys)
            if key != "cpus"}


def rule_threads(rule, per_model=False, run_of=lambda wildcards: wildcards.run):
    return _resource(rule, "cpus", per_model, run_of)


def model_resources(rule, model):
    """A rule's resources for a job of one model's grid points (a bundled job: no wildcards)."""
    values = STUDY.resources_for(rule, model)
    return {("gpu" if key == "gpus" else key): value for key, value in sorted(values.items()) if key != "cpus"}


include: "workflow/rules/prepare.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    """The report, and every run's and evaluation's `.done` file: a point discarded for a rerun (or a run directory
    deleted by hand) is then trained and evaluated again, and the report redone, even where the report is newer
    than every file that is left (Snakemake would otherwise leave a missing intermediate file missing)."""
    default_target: True
    input:
        rules.report.output,
        [WORK.done("train", run) for run in RUN_IDS],
        all_evaluations(),
