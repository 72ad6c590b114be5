"""Training over several nodes (trainer.srun): the commands a job of several nodes or CPU tasks runs, and
what each of its SLURM tasks hands the trainer. Model-free; the run itself, against the local SLURM
cluster, is in tests/test_slurm.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from snakemake_executor_plugin_submitit.resources import command_step, slurm_parameters
from trainer import srun
from trainer.launch import job_command, train_command


def test_one_node_with_its_gpus_starts_as_before():
    assert job_command("py") == train_command("py", 1) == ["py", "-m", "trainer"]
    assert job_command("py", gpus=1, cpus=8) == ["py", "-m", "trainer"]
    assert job_command("py", gpus=4, cpus=16) == train_command("py", 4)  # accelerate launch, 4 processes
    assert job_command("py", gpus=4, tasks=4) == train_command("py", 4)


def test_several_nodes_or_cpu_tasks_start_under_srun_with_their_share_of_the_cpus():
    def launch(**resources):
        command = job_command("py", **resources)
        assert command[:4] == ["py", "-m", "trainer.srun", "launch"], command
        options = dict(zip(command[4::2], command[5::2], strict=True))
        return int(options["--nodes"]), int(options["--tasks-per-node"]), int(options["--cpus-per-task"])

    assert launch(nodes=1, tasks=2, cpus=3) == (1, 2, 3)        # 2 CPU tasks of 3 CPUs
    assert launch(nodes=2, tasks=2, cpus=1) == (2, 2, 1)
    assert launch(nodes=2) == (2, 1, 1)                         # one process per node
    assert launch(nodes=4, gpus=8, cpus=32) == (4, 8, 4)        # one per GPU, the node's CPUs shared
    assert launch(nodes=2, gpus=8, cpus=2) == (2, 8, 1)


def test_the_training_step_is_one_srun_of_every_process():
    command = srun.srun_command("py", 2, 4, 8, ["train", "--config", "c.yaml", "--out", "runs/a"])
    assert command[0] == "srun" and "--overlap" in command and "--kill-on-bad-exit=1" in command
    assert {"--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--cpus-per-task=8"} <= set(command)
    assert command[-9:] == ["py", "-m", "trainer.srun", "task", "train", "--config", "c.yaml", "--out", "runs/a"]


def test_each_task_gets_torchs_variables_from_slurms():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_ID": "1234567"}
    assert srun.torch_environment(env, "node03") == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node03",
        "MASTER_PORT": str(srun.master_port("1234567"))}
    ports = {srun.master_port(str(job)) for job in range(1000, 1100)}
    assert len(ports) == 100 and all(srun.PORTS[0] <= p < srun.PORTS[1] for p in ports)


def test_rank_zeros_host_is_the_first_of_the_node_list_as_scontrol_expands_it():
    if shutil.which("scontrol") is None:  # SLURM's commands, without a cluster: the expansion is local
        if os.environ.get("KLSTUDY_REQUIRE_SLURM") == "1":
            pytest.fail("KLSTUDY_REQUIRE_SLURM=1 but scontrol is not installed (profiles/slurm/local-cluster.sh up)")
        pytest.skip("scontrol is not installed (profiles/slurm/local-cluster.sh up installs SLURM)")
    assert srun.first_host("node[03-05,7],gpu1") == "node03"


def test_without_scontrol_the_node_list_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(srun.LaunchError, match=r"scontrol is not on PATH.*node\[03-05\]"):
        srun.first_host("node[03-05]")


def test_several_nodes_outside_slurm_is_one_error():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, "-m", "trainer.srun", "launch", "--nodes", "2", "--tasks-per-node", "1",
                           "train", "--config", "missing.yaml"], capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "trainer.srun: this training job asks for 2 nodes, whose processes start with srun in a SLURM job, but it "
        "runs outside SLURM (no SLURM_JOB_ID): run the study with --profile profiles/slurm, or set nodes: 1")


def test_a_job_of_several_tasks_runs_its_command_once():
    """submitit's step runs one task: the job's command (Snakemake's) starts the others itself."""
    assert command_step(slurm_parameters({"nodes": 2}, 1, {})) == {"srun_args": ["--nodes=1", "--ntasks=1"]}
    assert command_step(slurm_parameters({"tasks": 2}, 1, {})) == {"srun_args": ["--nodes=1", "--ntasks=1"]}
    assert command_step(slurm_parameters({"nodes": 1, "tasks": 1, "gpus": 4}, 8, {})) == {}
