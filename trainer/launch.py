"""The command that starts a training run: one process, or one per GPU under `accelerate launch`.

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
