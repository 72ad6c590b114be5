"""The submitit executor against a real one-node SLURM cluster (profiles/slurm/local-cluster.sh up). (Its
parts that need no cluster: tests/test_submitit_plugin.py.)

Without a cluster these tests skip, unless KLSTUDY_REQUIRE_SLURM=1 (set by .ci/run, which brings the
cluster up): then a missing cluster is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit
import yaml
from run_helpers import assert_trains_as_one_process, default_sigint
from test_workflow import SNAKEMAKE

from snakemake_executor_plugin_submitit.command import JobCommand, live_stat
from snakemake_executor_plugin_submitit.launch import submitit_python
from trainer.run import TIMING_KEYS
from trainer.run_files import read_metrics

REPO = Path(__file__).resolve().parent.parent
# Status checks every second, not every 10 s as on a real cluster.
SLURM = ["--profile", str(REPO / "profiles" / "slurm"), "--seconds-between-status-checks", "1",
         "--max-status-checks-per-second", "10", "--latency-wait", "5"]

SMALL = {**yaml.safe_load((REPO / "benchmarks" / "slurm_study.yaml").read_text()), "results": "results"}
SMALL_RUNS = ["toy-sft__k1-reward__b0.1__s0", "toy-sft__none__s0"]


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "study.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake(directory: Path, config: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *args, "--directory", str(directory), "--configfile", str(config)],
                          capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def snakemake_running(log: Path, *args: str, **popen):
    """Snakemake started with `args`, its stderr in `log` (a file, not a pipe nobody drains while it runs),
    killed if it still runs when the block ends, so that a failed test leaves no Snakemake behind."""
    with log.open("w") as handle:
        process = subprocess.Popen([*SNAKEMAKE, *args], stdout=subprocess.DEVNULL, stderr=handle, **popen)
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def squeue() -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i %T %j"], capture_output=True, text=True).stdout.split("\n")[:-1]


def comparable(run: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in read_metrics(run / "metrics.jsonl")]


# --- against the cluster -------------------------------------------------------------------------


@pytest.mark.slow
def test_small_study_on_slurm_killed_mid_training_and_rerun_gives_the_local_outputs(slurm, tmp_path):
    """The study locally and on SLURM gives the same numbers, also when the Snakemake process on the login
    node is killed (kill -9) mid-training and the same command is run while its jobs still run: they are
    followed, not submitted again, and no run is trained by two jobs (every step once). The rerun used to
    submit them again, and two trainers wrote one run directory."""
    config = json.loads(json.dumps(SMALL))
    config["grid"]["baseline"] = False  # one run: SMALL_RUNS[0]
    steps = 400  # long enough that a second trainer would start while the first still runs
    config["run"]["train"].update(steps=steps, prompts_per_step=4)
    config["run"]["checkpoint"]["every"] = 20
    name = SMALL_RUNS[0]
    local_start = time.monotonic()
    local = snakemake(tmp_path / "local", write_config(tmp_path / "local", config), "--profile",
                      str(REPO / "profiles" / "local"), "--cores", "2")
    local_s = time.monotonic() - local_start
    assert local.returncode == 0, local.stderr[-4000:]

    directory = tmp_path / "slurm"
    path = write_config(directory, config)
    run = directory / "results" / "runs" / name
    with snakemake_running(tmp_path / "killed.log", *SLURM, "--directory", str(directory), "--configfile",
                           str(path), start_new_session=True) as killed:
        deadline = time.monotonic() + 600
        while not (len(read_metrics(run / "metrics.jsonl")) >= 2 and not (run / "COMPLETE").exists()):
            assert killed.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.1)
        killed.kill()  # the login node's snakemake dies; its SLURM jobs go on
        killed.wait(timeout=60)
    cluster_start = time.monotonic()
    cluster = snakemake(directory, path, *SLURM)
    cluster_s = time.monotonic() - cluster_start
    assert cluster.returncode == 0, cluster.stderr[-4000:]
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(steps))  # each step once
    assert re.search(r"SLURM job \S+ \(train\) of an earlier run of this study still runs: followed", cluster.stderr)
    assert "submitit: job scripts and logs in" in cluster.stderr
    jobs = len(re.findall(r"^Finished jobid", cluster.stderr, re.M))
    a, b = tmp_path / "local" / "results", directory / "results"
    assert comparable(a / "runs" / name) == comparable(b / "runs" / name)  # same numbers, step by step
    scores = [json.loads((r / "eval" / name / "toy" / "metrics.json").read_text())["tasks"]["arith"] for r in (a, b)]
    assert scores[0]["value"] == scores[1]["value"] and scores[0]["n"] == scores[1]["n"] == 10
    for table in ("results.md", "results.csv"):
        assert (a / "tables" / table).read_text() == (b / "tables" / table).read_text()
    # The jobs went through SLURM (both runs' folders): every one of them is in its accounting.
    ids = {p.name.split("_")[0] for p in (directory / ".snakemake" / "submitit").glob("*/*_log.out")}
    accounted = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(sorted(ids))],
                               capture_output=True, text=True).stdout
    assert len(ids) >= 5 and accounted.count("COMPLETED") >= len(ids)
    print(f"\nsmall study: local {local_s:.1f} s; on slurm, killed and rerun: the rerun {cluster_s:.1f} s, "
          f"{jobs} jobs")


def test_a_lease_held_in_a_slurm_job_is_live_while_slurm_runs_the_job(slurm):
    """A trainer's lease names its SLURM job: from another node, it is live while the job runs and
    stale once SLURM no longer has it (trainer.lease)."""
    from trainer.lease import why_stale

    sbatch = ["sbatch", "--parsable", "--wrap", "sleep 120", "--mem", "100M", "--output", "/dev/null"]
    job = subprocess.run(sbatch, capture_output=True, text=True, check=True).stdout.strip()
    try:
        holder = {"host": "another-node", "pid": 1, "slurm_job": job, "heartbeat": time.time()}
        deadline = time.monotonic() + 120
        while "RUNNING" not in subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                                              text=True).stdout:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert why_stale(holder) is None
    finally:
        subprocess.run(["scancel", job], check=True)
    deadline = time.monotonic() + 120
    while why_stale(holder) is None:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert why_stale(holder) in ("its SLURM job is no longer queued", "its SLURM job is completing",
                                 "its SLURM job is cancelled")


@pytest.mark.slow
def test_a_training_job_past_its_time_limit_is_requeued_and_resumes(slurm, tmp_path):
    config = json.loads(json.dumps(SMALL))
    config["grid"]["baseline"] = False
    # Jobs limited to 2 minutes, warned 90 s before the limit. SLURM may send the warning up to 60 s early
    # and checks every 30 s, so it comes at its first check after the job starts: an attempt runs 0-30 s,
    # start-up (about 8 s) included. 1200 steps are about 42 s of training on an idle 2-core machine (0.035 s
    # a step): with start-up, more than the 30 s an attempt can last unless a machine runs both 1.6 times as
    # fast, so the run needs at least one requeue. Once SLURM has requeued the job, its limit is raised, as an
    # operator extends a job, so that the next attempt finishes the run: left at 2 minutes, each attempt is
    # its start-up and a few seconds of training, and the attempts grow with the machine's load (27 attempts
    # and 11 minutes beside the other half of the suite).
    steps = 1200
    config["run"]["train"].update(steps=steps, prompts_per_step=16, group_size=4)
    config["run"]["checkpoint"]["every"] = 5
    config["resources"]["train"] = {"runtime": 2}
    target = f"results/.jobs/train/{SMALL_RUNS[0]}.done"  # training only: its requeues are the point
    with snakemake_running(tmp_path / "snakemake.log", *SLURM, "--submitit-signal-delay", "90",
                           "--submitit-max-timeouts", "30", target, "--directory", str(tmp_path), "--configfile",
                           str(write_config(tmp_path, config))) as process:
        metrics = tmp_path / "results" / "runs" / SMALL_RUNS[0] / "metrics.jsonl"
        extended = extend_once_requeued("smk-train", metrics, minutes=15, process=process, timeout=600)
        assert process.wait(timeout=900) == 0, (tmp_path / "snakemake.log").read_text()[-4000:]
    assert extended, "the training job finished without being requeued after a step"
    run = tmp_path / "results" / "runs" / SMALL_RUNS[0]
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(steps))  # none lost or repeated
    # the run's train.log, which every attempt appends to: the job's own log is its last attempt's, and that
    # attempt may only find the run complete (SLURM's warning came as the run completed, CI saw it)
    assert "resumed from checkpoint" in (run / "train.log").read_text()
    submitit_logs = "".join(p.read_text() for p in (tmp_path / ".snakemake" / "submitit").rglob("*_log.err"))
    assert "this job is timed-out" in submitit_logs and "DUE TO JOB REQUEUE" in submitit_logs


def scontrol_field(job: str, name: str) -> str:
    """One field of `scontrol show job` for `job` ("" when SLURM no longer knows the job)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    match = re.search(rf"\b{name}=(\S+)", shown)
    return match.group(1) if match else ""


def job_restarts(job: str) -> int:
    """How many times SLURM has requeued `job` (scontrol's Restarts)."""
    return int(scontrol_field(job, "Restarts") or 0)


def extend_once_requeued(name: str, metrics: Path, minutes: int, process: subprocess.Popen, timeout: float) -> bool:
    """Wait until SLURM has requeued the job named `name` after its run had trained a step (`metrics` has a
    line: a warning during loading leaves nothing to resume from), then raise its time limit to `minutes`;
    False if `process` (the Snakemake that submitted it) ends first."""
    deadline, requeues = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and process.poll() is None:
        trained = metrics.is_file() and metrics.read_text().strip() != ""  # read before the restarts
        for job in (line.split()[0] for line in squeue() if line.split()[2:] == [name]):
            restarts = job_restarts(job)
            if restarts > requeues:
                if trained:
                    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"], check=True)
                    return True
                requeues = restarts
        time.sleep(0.5)
    return False


@pytest.mark.slow
def test_a_job_signalled_as_its_run_completes_is_requeued_and_ends_as_a_success(slurm, tmp_path):
    """SLURM's warning (here sent by hand, as SLURM sends it: USR2 to the job's processes) reaches the job
    during its run's last step or after it: the run completes, the job is requeued all the same, and the
    requeued job's own Snakemake must still find the job it was submitted for. CI once saw it find no such
    job (a finished run was in no rule), so the study failed though its run had completed."""
    config = json.loads(json.dumps(SMALL))
    config["grid"]["baseline"] = False
    steps = 30
    config["run"]["train"].update(steps=steps, prompts_per_step=64, group_size=8)  # about 0.2 s a step
    run = tmp_path / "results" / "runs" / SMALL_RUNS[0]
    target = f"results/.jobs/train/{SMALL_RUNS[0]}.done"
    with snakemake_running(tmp_path / "snakemake.log", *SLURM, target, "--directory", str(tmp_path),
                           "--configfile", str(write_config(tmp_path, config))) as process:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps - 1:  # the last step runs
                [job] = [line.split()[0] for line in squeue() if "smk-train" in line]
                subprocess.run(["scancel", "--signal=USR2", job], check=True)
                break
            time.sleep(0.05)
        assert process.wait(timeout=600) == 0, (tmp_path / "snakemake.log").read_text()[-4000:]
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(steps))
    attempt = (tmp_path / "results" / "logs" / "train" / f"{SMALL_RUNS[0]}.log").read_text()
    assert "is already complete; nothing to do" in attempt  # the requeued job's trainer
    submitit_logs = "".join(p.read_text() for p in (tmp_path / ".snakemake" / "submitit").rglob("*_log.err"))
    assert "Caught signal SIGUSR2" in submitit_logs and "DUE TO JOB REQUEUE" in submitit_logs


@pytest.mark.slow
def test_a_warning_while_submitit_loads_the_job_waits_for_its_handler_and_the_job_is_requeued(slurm, tmp_path):
    """SLURM's time-limit warning comes at one of its checks, which with a short limit can fall in a job's
    first second, before submitit has installed its USR2 handler. CI once saw a job (a 2-minute limit) die of
    USR2 while submitit loaded its pickle: failed, not requeued. Here the warning comes while the task waits
    for its pickle, which the test holds back: it must stay pending in the task, then be taken by submitit
    (checkpoint, requeue), and the requeued job must run its command once."""
    folder = tmp_path / "submitit"
    executor = submitit.SlurmExecutor(folder=folder, python=submitit_python())  # as the plugin makes it
    executor.update_parameters(job_name="smk-early-warning", time=10, signal_delay_s=90,
                               additional_parameters={"hold": True})
    ran = tmp_path / "ran"
    job = executor.submit(JobCommand(f"echo ran >> {shlex.quote(str(ran))}", grace_s=10))
    held = job.paths.submitted_pickle.rename(folder / "held-back.pkl")  # submitit waits for it, uncovered
    subprocess.run(["scontrol", "release", job.job_id], check=True)
    task = wait_for(lambda: submitit_task(folder) if "Loading pickle" in logs(job) else None, 120)
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True)
    assert wait_for(lambda: not alive(task) or usr2_pending(task), 60)
    assert alive(task), f"the warning killed the task before submitit could take it:\n{logs(job)}"
    held.rename(job.paths.submitted_pickle)
    assert wait_for(lambda: ran.is_file() and scontrol_field(job.job_id, "JobState") == "COMPLETED", 300), logs(job)
    assert ran.read_text() == "ran\n" and job_restarts(job.job_id) == 1
    assert "Caught signal SIGUSR2" in logs(job)


def wait_for(found, timeout: float):
    """found()'s first true value within `timeout` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.2)
    return None


def logs(job: submitit.SlurmJob) -> str:
    """The job's submitit logs (every attempt appends), stdout then stderr."""
    return "".join(path.read_text() for path in (job.paths.stdout, job.paths.stderr) if path.is_file())


def submitit_task(folder: Path) -> int | None:
    """The pid of the Python process running submitit's job runner for `folder` on this node (not the srun
    that started it), if one runs."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            words = cmdline.read_bytes().decode().split("\0")
            if Path(words[0]).name.startswith("python") and "submitit.core._submit" in words and str(folder) in words:
                return int(cmdline.parent.name)
    return None


def alive(pid: int) -> bool:
    return live_stat(Path("/proc") / str(pid) / "stat") is not None


def usr2_pending(pid: int) -> bool:
    """Whether USR2 is pending in `pid` (sent to it and blocked there): /proc's ShdPnd mask."""
    with contextlib.suppress(OSError):
        status = (Path("/proc") / str(pid) / "status").read_text()
        return bool(int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.M).group(1), 16) & 1 << (signal.SIGUSR2 - 1))
    return False


@pytest.mark.slow
def test_interrupted_snakemake_leaves_no_job_in_squeue(slurm, tmp_path):
    config = json.loads(json.dumps(SMALL))
    config["run"]["train"]["steps"] = 2000  # jobs that would run for minutes
    with snakemake_running(tmp_path / "snakemake.log", *SLURM, "--directory", str(tmp_path), "--configfile",
                           str(write_config(tmp_path, config)), start_new_session=True,
                           preexec_fn=default_sigint) as process:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any("smk-train" in line and "RUNNING" in line for line in squeue()):
            assert process.poll() is None, (tmp_path / "snakemake.log").read_text()[-3000:]
            time.sleep(0.5)
        assert any("smk-train" in line for line in squeue())
        process.send_signal(signal.SIGINT)  # Ctrl-C on the submit host
        process.wait(timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and squeue():
        time.sleep(0.5)
    assert squeue() == []


@pytest.mark.slow
def test_ctrl_c_during_a_status_check_still_cancels_every_job(slurm, tmp_path):
    """Snakemake takes its active jobs out of its list while a status check runs
    (snakemake_interface_executor_plugins' RemoteExecutor._wait_for_jobs), so a Ctrl-C at that moment
    hands cancel_jobs an empty list: CI once saw the test above leave two training jobs running so. The
    plugin cancels every job it submitted and has not seen end, whatever list it is handed."""
    import submitit

    from snakemake_executor_plugin_submitit.executor import Executor

    submitter = submitit.SlurmExecutor(folder=tmp_path)
    submitter.update_parameters(time=5, cpus_per_task=1, job_name="smk-status-check")
    job = submitter.submit(time.sleep, 300)
    plugin = Executor.__new__(Executor)  # only its record of this run's jobs: the rest needs a workflow
    plugin.unfinished = {job.job_id: job}
    try:
        Executor.cancel_jobs(plugin, [])  # Snakemake's list, emptied by a status check
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(line.startswith(f"{job.job_id} ") for line in squeue()):
            time.sleep(0.5)
        assert not any(line.startswith(f"{job.job_id} ") for line in squeue())
    finally:  # the queue empty for the tests after this one, whatever happened
        job.cancel(check=False)


@pytest.mark.slow
def test_a_failing_job_names_its_log(slurm, tmp_path):
    config = json.loads(json.dumps(SMALL))
    # a directory the study check accepts (it holds a config.json), but no tokenizer: the prepare job fails
    broken = tmp_path / "no-tokenizer"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    config["models"] = {"missing": {"path": str(broken)}}
    result = snakemake(tmp_path, write_config(tmp_path, config), *SLURM)
    assert result.returncode != 0
    match = re.search(r"SLURM job (\S+) ended FAILED\. Its log: (\S+)", result.stderr)
    assert match, result.stderr[-4000:]
    log = Path(match.group(2))
    assert log.is_file() and "exited with status" in log.read_text()
    assert "could not load the tokenizer" in (tmp_path / "results" / "logs" / "prepare" / "missing.log").read_text()


@pytest.mark.slow
def test_two_slurm_tasks_train_as_one_process_does(slurm, tmp_path):
    """resources.train {tasks: 2}: the training job's command (Snakemake's) runs once, and starts the two
    training processes as one srun step (trainer.srun: gloo, FSDP2), the code path of a job of two nodes,
    whose srun spans both. Their losses and final weights are one process's on the same batches."""
    from safetensors.torch import load_file

    config = json.loads(json.dumps(SMALL))
    config["grid"]["baseline"] = False
    lr, steps = 1e-3, 2
    config["run"]["train"].update(steps=steps, lr=lr)
    config["resources"]["train"] = {"tasks": 2, "cpus": 1}
    name = SMALL_RUNS[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([*SNAKEMAKE, *SLURM, f"results/.jobs/train/{name}.done", "--directory", str(tmp_path),
                           "--configfile", str(write_config(tmp_path, config))],
                          capture_output=True, text=True, timeout=900, env=env)
    study_s = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-4000:]
    run = tmp_path / "results" / "runs" / name
    log = (tmp_path / "results" / "logs" / "train" / f"{name}.log").read_text()
    # one command, two processes: each joined the group once
    assert log.count("process 0 of 2") == 1 and log.count("process 1 of 2") == 1, log[-3000:]
    # the job asked SLURM for two tasks; submitit's own step ran one; the trainers were a step of two tasks
    scripts = {p.name.split("_")[0]: p.read_text()
               for p in (tmp_path / ".snakemake" / "submitit").glob("*/*_submission.sh")}
    train_job, script = next((job, text) for job, text in scripts.items() if "--ntasks-per-node=2" in text)
    assert "srun --unbuffered" in script and "--nodes=1 --ntasks=1" in script, script
    steps_of_job = subprocess.run(["sacct", "-n", "-P", "-o", "JobID,NTasks,State", "-j", train_job],
                                  capture_output=True, text=True).stdout.split()
    assert any(line.split("|")[1:] == ["2", "COMPLETED"] and ".batch" not in line for line in steps_of_job), \
        steps_of_job

    # one process on the same batches: the same config file, by hand, in the study's directory
    config_file = tmp_path / "results" / "configs" / f"{name}.yaml"
    one = tmp_path / "one"
    alone = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(config_file), "--out", str(one)],
                           capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    model = tmp_path / yaml.safe_load(config_file.read_text())["model"]["path"]  # the study's prepared model
    loss_gap, floor = assert_trains_as_one_process(one, run, config_file, model)
    weights = [load_file(r / "final" / "model.safetensors") for r in (one, run)]
    gaps = {key: float((weights[0][key] - weights[1][key]).abs().max()) for key in weights[0]}
    # (the two processes also write lm_head.weight, which the one process leaves to its tie)
    assert weights[0].keys() <= weights[1].keys() and max(gaps.values()) <= 0.01 * steps * lr, gaps
    print(f"\ntwo SLURM tasks vs one process: loss differs by at most {loss_gap:.3g} (noise floor {floor:.3g}), "
          f"weights by at most {max(gaps.values()):.3g} (bound {0.01 * steps * lr:.3g}); study {study_s:.1f} s")


@pytest.mark.slow
def test_a_two_task_training_step_stops_at_a_checkpoint_on_sigterm_and_resumes(slurm, warm_model, tmp_path):
    """What the executor does before a time limit: SIGTERM to the job command's process group, here the
    launcher's (srun itself would kill its tasks on SIGTERM: it runs apart and gets SIGUSR1, which each task
    turns into SIGTERM to its trainer). Both trainers checkpoint and stop; the same command resumes."""
    from run_helpers import TOY_RUN, overrides

    from trainer.launch import job_command

    out = tmp_path / "run"
    steps = 40
    command = shlex.join([*job_command(sys.executable, tasks=2), "train", "--out", str(out),
                          *overrides(warm_model, TOY_RUN, **{"train.steps": steps, "checkpoint.every": 100})])
    pid_file = tmp_path / "launcher.pid"

    def submit(log: Path) -> str:
        script = f"echo $$ > {pid_file}; exec {command} > {log} 2>&1"
        return subprocess.run(["sbatch", "--parsable", "--ntasks=2", "--cpus-per-task=1", "--mem=3000M",
                               "--output", str(tmp_path / "sbatch.out"), "--wrap", script],
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.strip()

    def wait_for(job: str) -> str:
        """The job's State|ExitCode once it has left the queue and its accounting has its end: slurmdbd may
        record the end a moment after squeue drops the job (under CI's load, this test read a state too early)."""
        deadline = time.monotonic() + 300
        while True:
            assert time.monotonic() < deadline, job
            if not any(line.split()[0] == job for line in squeue()):
                state = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", job],
                                       capture_output=True, text=True).stdout.strip()
                if state.split("|")[0] not in ("", "PENDING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED"):
                    return state
            time.sleep(0.5)

    first = submit(tmp_path / "first.log")
    deadline = time.monotonic() + 300
    while len(read_metrics(out / "metrics.jsonl")) < 3:
        assert time.monotonic() < deadline and any(line.split()[0] == first for line in squeue()), \
            (tmp_path / "first.log").read_text()[-3000:] if (tmp_path / "first.log").exists() else "no log"
        time.sleep(0.2)
    launcher = int(pid_file.read_text())
    os.killpg(os.getpgid(launcher), signal.SIGTERM)
    state = wait_for(first)
    log = (tmp_path / "first.log").read_text()
    assert state.startswith("FAILED|75"), (state, log[-3000:])
    assert log.count("checkpoint written, exiting with 75") == 2, log[-3000:]  # both processes stopped cleanly
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    assert len(saved) == 1 and not (out / "COMPLETE").exists(), saved
    state = wait_for(submit(tmp_path / "second.log"))
    log = (tmp_path / "second.log").read_text()
    assert state.startswith("COMPLETED"), (state, log[-3000:])
    assert log.count(f"resumed from checkpoint {saved[0]}") == 2, log[-3000:]
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == list(range(steps))  # none lost or repeated


@pytest.mark.slow
def test_a_study_whose_sacct_fails_says_why_and_goes_on_once_it_answers(slurm, tmp_path):
    """SLURM's accounting daemon stops while a job runs: sacct fails, and submitit keeps the job's old
    state, so the study used to wait without a word. Now it says why; once slurmdbd is back, the job,
    finished meanwhile, is seen and the study ends."""
    (tmp_path / "Snakefile").write_text('rule all:\n    output: "done"\n    shell: "sleep 15; touch {output}"\n')
    cpus = node_cpus()
    log_path = tmp_path / "snakemake.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "snakemake", "--snakefile", str(tmp_path / "Snakefile"),
                                    *SLURM, "--directory", str(tmp_path), "--jobs", "1"],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not any("RUNNING smk-all" in line for line in squeue()):
            assert time.monotonic() < deadline and process.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.5)
        subprocess.run(["pkill", "-x", "slurmdbd"], check=True)
        deadline = time.monotonic() + 120
        while "sacct has failed" not in log_path.read_text():
            assert time.monotonic() < deadline and process.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.5)
    finally:  # the cluster is whole again for the tests after this one
        subprocess.run([str(REPO / "profiles" / "slurm" / "local-cluster.sh"), "up"], check=True,
                       capture_output=True)
    assert process.wait(timeout=300) == 0, log_path.read_text()[-3000:]
    text = log_path.read_text()
    assert (tmp_path / "done").exists() and "slurmdbd and its database" in text and "sacct answers again" in text
    assert node_cpus() == cpus  # the `up` above ran with this suite's OMP_NUM_THREADS, which is not the node's size


def node_cpus() -> str:
    return subprocess.run(["sinfo", "-h", "-n", "localhost", "-o", "%c"], capture_output=True, text=True).stdout.strip()
