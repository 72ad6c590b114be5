"""Snakemake job resources -> submitit's SlurmExecutor parameters."""

from __future__ import annotations

from typing import Any, Mapping

# Snakemake resource -> SlurmExecutor parameter, for the ones that pass through unchanged.
_DIRECT = {
    "nodes": "nodes",
    "tasks": "ntasks_per_node",
    "slurm_partition": "partition",
    "slurm_account": "account",
    "slurm_qos": "qos",
    "constraint": "constraint",
}


def slurm_parameters(resources: Mapping[str, Any], threads: int, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The sbatch parameters of one job. `defaults` (partition, account, qos from the executor
    settings) apply where the job's resources say nothing."""
    params: dict[str, Any] = {key: value for key, value in defaults.items() if value not in (None, "")}
    params["cpus_per_task"] = max(1, int(threads))
    gpus = resources.get("gpus", resources.get("gpu"))
    if gpus:
        params["gpus_per_node"] = int(gpus)
    if resources.get("mem_mb"):
        params["mem"] = f"{int(resources['mem_mb'])}M"
    if resources.get("runtime"):
        params["time"] = int(resources["runtime"])  # minutes
    for resource, parameter in _DIRECT.items():
        if resources.get(resource) not in (None, ""):
            params[parameter] = resources[resource]
    return params


def command_step(params: Mapping[str, Any]) -> dict[str, Any]:
    """submitit's own step in the job script (its `srun`), for a job of these sbatch parameters: one task,
    whatever the job's nodes and tasks, so that Snakemake's job command runs once per job and not once
    per task. A job of several tasks starts them itself, as a training job of several nodes does
    (trainer.srun); submitit's default would run the whole command, Snakemake and all, in every task."""
    tasks = int(params.get("nodes") or 1) * int(params.get("ntasks_per_node") or 1)
    return {"srun_args": ["--nodes=1", "--ntasks=1"]} if tasks > 1 else {}


def signature(params: Mapping[str, Any]) -> tuple:
    """Jobs with equal signatures can share one job array."""
    return tuple(sorted((key, str(value)) for key, value in params.items()))
