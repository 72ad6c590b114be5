"""Training processes on several nodes (or several CPU tasks) of one SLURM job, started by SLURM itself.

`python -m trainer.srun launch --nodes N --tasks-per-node P --cpus-per-task C train ...` is the command
of such a training job (trainer.launch.job_command). It runs once per job, in the job's first step,
and starts the N x P training processes as one job step with `srun` (one SLURM task per process, on
every node of the allocation). Each task runs `python -m trainer.srun task train ...`, which turns
SLURM's description of the task into torch's (RANK, WORLD_SIZE, LOCAL_RANK from SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR, the step's first node, which holds rank 0; MASTER_PORT, from
the job id) and runs `python -m trainer train ...` with it: trainer.distributed joins the process
group through torch's env:// rendezvous, as under `accelerate launch`.

Signals. A job is told to stop (its time limit near, or a preemption) by SIGTERM to its command's
process group (the submitit executor's JobCommand.checkpoint). srun answers SIGTERM by killing its
tasks (SIGKILL, "forcing job termination"), so srun runs in a session of its own, out of that group,
and `launch` passes the stop on as SIGUSR1, which srun forwards to every process of the step: the
task wrapper ignores it in the trainer and sends the trainer SIGTERM, and the trainer checkpoints
after its current step as it does anywhere (trainer.run.loop). SIGUSR2, SLURM's own warning before
the time limit, reaches every step: the executor's step acts on it, the training step ignores it.

Outside a SLURM job (Snakemake's local executor), one node is run as `accelerate launch` of P
processes on this machine; more than one node cannot be, and is an error that says so.

Free of torch, like trainer.launch: the task wrapper only sets variables and waits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Mapping

from trainer.launch import train_command

STOP = signal.SIGUSR1  # what `launch` sends srun to stop the trainers gently (srun kills on SIGTERM)
PORTS = (20000, 40000)  # MASTER_PORT: in this range, from the job id


class LaunchError(RuntimeError):
    """The training job cannot start its processes here."""


def srun_command(python: str, nodes: int, tasks_per_node: int, cpus_per_task: int, args: list[str]) -> list[str]:
    """The job step of the training processes. --overlap: the step shares the CPUs of the job's first
    step, which runs this launcher (and the executor's watcher) on the first node; --kill-on-bad-exit:
    a process that fails stops the others, which would otherwise wait for it in a collective."""
    return ["srun", "--overlap", "--kill-on-bad-exit=1", "--unbuffered", f"--nodes={nodes}",
            f"--ntasks={nodes * tasks_per_node}", f"--ntasks-per-node={tasks_per_node}",
            f"--cpus-per-task={cpus_per_task}", python, "-m", "trainer.srun", "task", *args]


def master_port(job_id: str) -> int:
    """A port for the rendezvous that two jobs sharing a node seldom both take: from the job id."""
    low, high = PORTS
    return low + int(job_id) % (high - low)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (`node[03-05,7],gpu1` -> node03), as scontrol expands it."""
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    except FileNotFoundError:
        raise LaunchError(f"scontrol is not on PATH, and it expands the job's node list ({nodelist}): run the "
                          "training tasks on the cluster's nodes, where SLURM's commands are") from None
    hosts = done.stdout.split()
    if done.returncode != 0 or not hosts:
        raise LaunchError(f"scontrol show hostnames {nodelist} failed: {done.stderr.strip() or 'no host'}")
    return hosts[0]


def torch_environment(env: Mapping[str, str], host: str) -> dict[str, str]:
    """torch's distributed variables for the SLURM task that `env` describes; `host` holds rank 0."""
    size = env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": size, "LOCAL_RANK": env["SLURM_LOCALID"],
            "MASTER_ADDR": host, "MASTER_PORT": str(master_port(env["SLURM_JOB_ID"]))}


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal s: 128 + s, as a shell says it


def launch(nodes: int, tasks_per_node: int, cpus_per_task: int, args: list[str]) -> int:
    """Start the training processes (see the module's doc); their exit status."""
    if "SLURM_JOB_ID" not in os.environ:
        if nodes > 1:
            raise LaunchError(f"this training job asks for {nodes} nodes, whose processes start with srun in a "
                              "SLURM job, but it runs outside SLURM (no SLURM_JOB_ID): run the study with "
                              "--profile profiles/slurm, or set nodes: 1")
        command = [*train_command(sys.executable, tasks_per_node), *args]
        os.execvp(command[0], command)  # one machine: as a job with that many GPUs starts
    held = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    if held < nodes:
        raise LaunchError(f"this training job asks for {nodes} nodes, but its SLURM job "
                          f"{os.environ['SLURM_JOB_ID']} holds {held}")
    step = subprocess.Popen(srun_command(sys.executable, nodes, tasks_per_node, cpus_per_task, args),
                            start_new_session=True)

    def stop(signum, frame):
        print(f"trainer.srun: {signal.Signals(signum).name}: telling the {nodes * tasks_per_node} training "
              "processes to checkpoint and stop", file=sys.stderr, flush=True)
        step.send_signal(STOP)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return _status(step.wait())


def task(args: list[str]) -> int:
    """One training process of the step: torch's variables from SLURM's, then the trainer, stopped
    gently (SIGTERM) when the launcher's STOP or SLURM's own SIGTERM comes."""
    env = os.environ
    host = first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
    # Ignored from here, so in the trainer too: STOP and SIGUSR2 reach every process of the step.
    signal.signal(STOP, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    trainer = subprocess.Popen([sys.executable, "-m", "trainer", *args], env={**env, **torch_environment(env, host)})

    def stop(signum, frame):
        if trainer.poll() is None:
            trainer.send_signal(signal.SIGTERM)

    signal.signal(STOP, stop)
    signal.signal(signal.SIGTERM, stop)
    status = trainer.wait()
    # The trainer is gone: a SIGTERM now (srun's, as another task exited 75) must not replace its status.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return _status(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.srun", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    start = sub.add_parser("launch", help="start the training processes with srun (once per job)")
    start.add_argument("--nodes", type=int, required=True)
    start.add_argument("--tasks-per-node", type=int, required=True)
    start.add_argument("--cpus-per-task", type=int, default=1)
    start.add_argument("args", nargs=argparse.REMAINDER, help="the trainer's arguments (train ... or train-runs ...)")
    one = sub.add_parser("task", help="one training process (what srun starts)")
    one.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    try:
        if options.what == "launch":
            return launch(options.nodes, options.tasks_per_node, options.cpus_per_task, options.args)
        return task(options.args)
    except LaunchError as error:
        print(f"trainer.srun: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
