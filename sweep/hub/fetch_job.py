"""What a fetch_model job (workflow/rules/prepare.smk) asks for: the rule's resources, and the plan's.

Such a job only checks that its model loads offline, a local directory or a hub model that Snakemake's own
process fetched into the cache before any job (sweep.hub.fetch): `python -m trainer fetch-model` loads its
tokenizer (trainer.model.models.fetch), about 0.4 GB for a few seconds. The prepare jobs' resources are
sized to build and import models (paper.yaml: 32 GB for two hours), and a job per model that asked for them
waited in the queue for a node it did not need.
"""

from __future__ import annotations

from typing import Any

from sweep.study.grid import Study

CHECK = {"cpus": 1, "mem_mb": 2000, "runtime": 15, "gpus": 0}  # a tokenizer's load, with room to spare
WHERE = ("slurm_partition", "slurm_account", "slurm_qos", "constraint")  # where the prepare jobs may run


def fetch_model_resources(study: Study) -> dict[str, Any]:
    """One CPU, 2 GB and 15 minutes (never more than a prepare job gets), where the prepare jobs run."""
    prepare = study.resources_for("prepare")
    small = {key: min(value, prepare.get(key, value)) for key, value in CHECK.items()}
    return {**small, **{key: prepare[key] for key in WHERE if key in prepare}}
