"""The command that starts a training run: one process, one per GPU under `accelerate launch`, or, for
a job of several nodes (or several CPU tasks), one per SLURM task under `srun` (trainer.srun).

Free of torch, so that the Snakefile can build every job's command without importing it.
"""

from __future__ import annotations

# How long the launcher lets its processes finish a step and checkpoint after SIGTERM before it kills
# them (torch's default is 30 s, shorter than one step of a large model). The scheduler's own time
# limit still bounds it.
SHUTDOWN_GRACE_S = 3600


def train_command(python: str, processes: int) -> list[str]:
    """`python -m trainer`, or `accelerate launch` of it with `processes` processes on this machine.

    accelerate's own mixed precision stays off: the trainer applies train.mixed_precision itself
    (FSDP2's policy), and port 0 lets several multi-GPU jobs share a node without colliding."""
    if processes <= 1:
        return [python, "-m", "trainer"]
    return ["env", f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={SHUTDOWN_GRACE_S}",
            python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
            "-m", "trainer"]


def processes_per_node(gpus: int = 0, tasks: int = 1) -> int:
    """One training process per GPU of a node; on CPU, one per SLURM task of the node."""
    return int(gpus) if gpus else max(1, int(tasks))


def srun_step(nodes: int = 1, gpus: int = 0, tasks: int = 1, cpus: int = 1) -> tuple[int, int] | None:
    """(processes per node, CPUs per process) of the SLURM job step a training job of these resources starts
    (see `job_command`), or None for a job that starts none (one node with its GPUs, or one CPU task). Each
    process gets an even share of its node's CPUs, and one at least: with fewer CPUs than processes per node
    the step asks more than its job holds (sweep.study.study_check refuses such a config)."""
    nodes, tasks, cpus = int(nodes), max(1, int(tasks)), max(1, int(cpus))
    if nodes == 1 and (gpus or tasks == 1):
        return None
    per_node = processes_per_node(gpus, tasks)
    return per_node, max(1, tasks * cpus // per_node)


def job_command(python: str, nodes: int = 1, gpus: int = 0, tasks: int = 1, cpus: int = 1) -> list[str]:
    """The command of a training job with these resources (`gpus`, `tasks` and `cpus` as SLURM gives them:
    GPUs per node, tasks per node, CPUs per task). One node with its GPUs: `train_command`, as ever.
    Several nodes, or several CPU tasks: `python -m trainer.srun launch`, which starts one process per
    GPU (or task) of every node as one SLURM job step (`srun_step`)."""
    step = srun_step(nodes, gpus, tasks, cpus)
    if step is None:
        return train_command(python, processes_per_node(gpus, tasks))
    return [python, "-m", "trainer.srun", "launch", "--nodes", str(int(nodes)), "--tasks-per-node", str(step[0]),
            "--cpus-per-task", str(step[1])]
