"""What a study will do, said before it does it: the Snakefile prints this on a dry run (`snakemake -n`).

Per group of jobs (prepare; train and evaluate per model, as models may set their own resources, for
the work left: a finished run or evaluation is in no job; track; report): how many jobs, the
resources each gets from the study config, and the sbatch options the submitit executor
(profiles/slurm) gives them, with the partition, account and QOS that come from its settings
(`--submitit-partition ...` on the command line, else the environment's SNAKEMAKE_SUBMITIT_PARTITION
..., else the profile's config.yaml; a rule's `slurm_partition` resource wins over them). Then each
run's state: it starts fresh, resumes from step N (the newest checkpoint that passes the trainer's own
check), or is finished. Last, the budget of the work left (sweep.study.budget): GPU-hours per group and
for the study, and whether a stopped job has the time to save its run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Mapping

from snakemake_executor_plugin_submitit.resources import slurm_parameters
from sweep.hub.fetch_job import fetch_model_resources
from sweep.study import budget
from sweep.study.executor_settings import executor_setting
from sweep.study.grid import Study
from sweep.study.jobs import Work
from trainer.run_files import COMPLETE

SETTINGS = ("partition", "account", "qos")  # the executor's defaults for every job
_SBATCH_ORDER = ("cpus_per_task", "gpus_per_node", "mem", "time", "nodes", "ntasks_per_node", "partition",
                 "account", "qos", "constraint")


def slurm_defaults(argv: list[str], environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """setting -> (value, where it came from), for the settings that have one (sweep.study.executor_settings)."""
    found = {name: executor_setting(name, argv, environ) for name in SETTINGS}
    return {name: value for name, value in found.items() if value}


def sbatch_options(resources: Mapping[str, Any], defaults: Mapping[str, str]) -> str:
    """A job's sbatch options as the submitit executor sets them (`--cpus-per-task=4 --mem=8000M ...`)."""
    params = slurm_parameters(resources, resources.get("cpus", 1), defaults)
    ordered = sorted(params, key=lambda key: _SBATCH_ORDER.index(key) if key in _SBATCH_ORDER else len(_SBATCH_ORDER))
    return " ".join(f"--{key.replace('_', '-')}={params[key]}" for key in ordered)


def prepare_jobs(study: Study) -> int:
    """The prepare jobs the DAG holds but fetch_model's: a model (built or imported), an evaluation data set
    or the audit whose output is not there yet."""
    data = [name for name in study.data if name in study.evaluate["data"].values()]
    outputs = [*(study.model_ready(name) for name, spec in study.models.items() if spec.prepared),
               *map(study.data_file, data), study.results / "audit" / "gradient_audit.csv"]
    return sum(not path.exists() for path in outputs)


def fetch_model_jobs(study: Study) -> int:
    """fetch_model's jobs in the DAG: a model only checked (a local directory or a hub id) and not ready yet."""
    return sum(not study.model_ready(name).exists() for name, spec in study.models.items() if not spec.prepared)


def job_groups(study: Study, work: Work) -> list[tuple[str, int, dict[str, Any]]]:
    """(what, how many jobs, the resources of each), as the rules in workflow/rules make them: fetch_model's
    small jobs apart from the other prepare jobs (sweep.hub.fetch_job); train and evaluate jobs for the pending
    work only (sweep.study.jobs), per model (models whose jobs get the same resources share a group)."""
    prepare, fetches = prepare_jobs(study), fetch_model_jobs(study)
    groups = [("prepare", prepare, study.resources_for("prepare"))] if prepare else []
    groups += [("prepare, fetch_model", fetches, fetch_model_resources(study))] if fetches else []
    model = {run.run_id: run.model for run in study.runs}
    evaluated = {target.key: target.run for target in work.evaluations}
    jobs_of = {"train": [bundle.pending[0] for bundle in work.train_bundles] if study.bundle["train"] > 1
               else work.runs,
               "evaluate": [evaluated[bundle.pending[0]] for bundle in work.evaluate_bundles]
               if study.bundle["evaluate"] > 1 else list(evaluated.values())}
    for rule in ("train", "evaluate"):
        alike: dict[str, tuple[list[str], int, dict[str, Any]]] = {}
        for name in study.models:
            jobs = sum(model[run] == name for run in jobs_of[rule])
            resources = study.resources_for(rule, name)
            same = repr(sorted(resources.items()))
            names, count, _ = alike.get(same, ([], 0, resources))
            alike[same] = ([*names, name], count + jobs, resources)
        groups += [(f"{rule}, {', '.join(names)}", count, resources) for names, count, resources in alike.values()
                   if count]
    return groups + [(rule, 1, study.resources_for(rule)) for rule in ("track", "report")]


def run_state(run_dir: Path) -> tuple[str, int | None]:
    """("finished" | "resumes" | "fresh", the step it resumes from)."""
    if (run_dir / COMPLETE).exists():
        return "finished", None
    checkpoints = run_dir / "checkpoints"
    steps = sorted((int(p.name[5:]) for p in checkpoints.glob("step_*") if p.name[5:].isdigit() and p.is_dir()),
                   reverse=True) if checkpoints.is_dir() else []
    if steps:
        from trainer.checkpoint import verify  # torch: only where there are checkpoints to check

        for step in steps:
            if verify(checkpoints / f"step_{step}") is None:
                return "resumes", step
    return "fresh", None


def plan(study: Study, work: Work, argv: list[str], environ: Mapping[str, str],
         discarded: Collection[str] = ()) -> list[str]:
    """The plan's lines; `discarded`: runs a dry run of a rerun would move aside (they start fresh)."""
    settings = slurm_defaults(argv, environ)
    defaults = {name: value for name, (value, _) in settings.items()}
    said = [f"{name} {value} (from {source})" for name, (value, source) in settings.items()]
    unset = [f"SNAKEMAKE_SUBMITIT_{name.upper()}" for name in SETTINGS if name not in settings]
    lines = [f"klstudy plan: study {study.name}, {len(study.runs)} runs, results in {study.results}/",
             "  SLURM (profiles/slurm): " + "; ".join(
                 [*said, *([f"no {', '.join(unset)}: the cluster's defaults"] if unset else [])]),
             "  the jobs of the work left (train and evaluate: the pending runs and evaluations) and what each gets"
             " (cpus are Snakemake's threads; on SLURM, the sbatch options):"]
    groups = job_groups(study, work)
    for what, jobs, resources in groups:
        shown = ", ".join(f"{key} {value}" for key, value in resources.items())
        lines += [f"    {what}: {jobs} job{'s' * (jobs != 1)}", f"      resources {shown}",
                  f"      sbatch {sbatch_options(resources, defaults)}"]
    states = {run.run_id: ("fresh", None) if run.run_id in discarded else run_state(study.results / "runs" / run.run_id)
              for run in study.runs}
    counts = {state: sum(1 for s, _ in states.values() if s == state) for state in ("fresh", "resumes", "finished")}
    lines.append(f"  runs: {counts['fresh']} start fresh, {counts['resumes']} resume from a checkpoint, "
                 f"{counts['finished']} finished")
    for run, (state, step) in states.items():
        if state == "resumes":
            lines.append(f"    {run} resumes from step {step} of {budget.steps_of(study.run(run).config)}")
    steps_left = {run: budget.steps_of(study.run(run).config) - (step or 0)
                  for run, (state, step) in states.items() if state != "finished"}
    return lines + budget.budget_lines(study, groups, steps_left, budget.signal_delay(argv, environ))
