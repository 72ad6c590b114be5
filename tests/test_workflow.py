"""The Snakemake study, run for real: a reduced toy grid end to end, interrupted by a real signal and
resumed; bad study configs stopped before any job; the paper study's DAG. (The grid without Snakemake:
tests/test_study_grid.py.)"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from run_helpers import default_sigint

from sweep.study.grid import load_study
from trainer.run_files import COMPLETE, read_metrics

REPO = Path(__file__).resolve().parent.parent
# Every Snakemake the suite starts. A job's torch gets one thread: Snakemake sets OMP_NUM_THREADS to the rule's
# threads (a study's `resources: cpus`, 2 in smol_cpu.yaml and paper_cpu.yaml), and the suite's two workers share
# 2 cores, so a second thread waits, spinning, for a core the other worker holds. The SmolLM2 smoke study beside
# a busy core: 376 s of CPU and 325 s wall with two threads, 172 s and 164 s with one (docs/testing.md).
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--max-threads", "1"]
LOCAL = ["--profile", str(REPO / "profiles" / "local"), "--cores", "2"]

REDUCED = {
    "study": "toy-test",
    "results": "results",
    "models": {"toy-sft": {"build": {"toy": {}, "sft": {"task": "arithmetic", "options": {"max_operand": 9},
                                                          "steps": 60}}}},
    "grid": {"estimators": ["k1", "k3"], "placements": ["reward", "loss"], "betas": [0.1], "seeds": [0],
             "exclude": [{"estimator": "k1", "placement": "loss"}]},
    "run": {"task": {"name": "arithmetic", "options": {"max_operand": 9}}, "rollout": {"max_new_tokens": 4,
            "stop": ["\n"]}, "train": {"steps": 6, "prompts_per_step": 8, "group_size": 4, "lr": 3e-4},
            "checkpoint": {"every": 3}},
    "data": {"heldout": {"task": "arithmetic", "options": {"max_operand": 9, "seed": 1}, "n": 20}},
    "evaluate": {"suites": ["toy"], "samples": 2, "every": 3, "data": {"arith": "heldout"}},
}
REDUCED_RUNS = ["toy-sft__k1-reward__b0.1__s0", "toy-sft__k3-reward__b0.1__s0", "toy-sft__k3-loss__b0.1__s0",
                "toy-sft__none__s0"]


def toy_config() -> dict:
    """The main job's study config, a fresh copy to change."""
    return yaml.safe_load((REPO / "workflow" / "config" / "toy.yaml").read_text())


def write_config(directory: Path, config: dict) -> Path:
    path = directory / "study.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake(directory: Path, config: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *LOCAL, "--directory", str(directory), "--configfile", str(config), *args],
                          capture_output=True, text=True, timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"})


# The outputs of a study's prepare jobs (build_model, prepare_data, audit) for REDUCED and its variants.
PREPARED = [str(load_study(REDUCED).model_ready("toy-sft")), str(load_study(REDUCED).data_file("heldout")),
            "results/audit/gradient_audit.csv"]


def prepare(directory: Path, config: dict, profile: list[str] = LOCAL) -> Path:
    """`directory` with the study's prepare jobs run through Snakemake, and nothing else: the toy model built
    and warmed up, the held-out data, the gradient audit (about half of a reduced study's time)."""
    done = subprocess.run([*SNAKEMAKE, *PREPARED, *profile, "--directory", str(directory), "--configfile",
                           str(write_config(directory, config))], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


def from_prepared(directory: Path, prepared: Path) -> None:
    """`directory`, whose study.yaml has `prepared`'s models and data, as it stands after its prepare jobs:
    `prepared`'s outputs and logs, with their mtimes, and Snakemake's records of them (so that nothing in them
    is out of date). The reduced studies share one prepare stage this way (conftest.prepared_toy_study); each
    still runs every other job of its own."""
    mine, theirs = (yaml.safe_load((d / "study.yaml").read_text()) for d in (directory, prepared))
    assert {k: mine[k] for k in ("models", "data")} == {k: theirs[k] for k in ("models", "data")}
    # not its config files, nor its claim on the directory (sweep.study.owner: the study here has a name of its own)
    shutil.copytree(prepared / "results", directory / "results", ignore=shutil.ignore_patterns("configs", "study.json"))
    shutil.copytree(prepared / ".snakemake" / "metadata", directory / ".snakemake" / "metadata")


def jobs_run(log: str, rule: str) -> list[str]:
    """The `run` wildcard of every job of `rule` that a Snakemake log shows starting."""
    return [run for run, _ in _jobs(log, rule)]


def jobs_finished(log: str, rule: str) -> list[str]:
    """The `run` wildcard of every job of `rule` that a Snakemake log shows finishing."""
    done = set(re.findall(rf"Finished jobid: (\d+) \(Rule: {rule}\)", log))
    return [run for run, jobid in _jobs(log, rule) if jobid in done]


def _jobs(log: str, rule: str) -> list[tuple[str, str]]:
    found = []
    for block in re.split(r"\n(?=\[)", log):
        if re.search(rf"^(local)?rule {rule}:", block, re.M):
            found.append((re.search(r"wildcards: run=([^,\s]+)", block).group(1),
                          re.search(r"jobid: (\d+)", block).group(1)))
    return found


def planned_jobs(stdout: str) -> dict[str, int]:
    """The jobs of each stage (prepare, train, evaluate, track, report) in a dry run's plan (sweep.study.plan)."""
    jobs: dict[str, int] = {}
    for stage, count in re.findall(r"^    (\w+)(?:, [^:]+)?: (\d+) jobs?$", stdout, re.M):
        jobs[stage] = jobs.get(stage, 0) + int(count)
    return jobs


def snakemake_jobs(counts: dict[str, int]) -> dict[str, int]:
    """Snakemake's job counts per rule (`-n --quiet rules`), summed per stage of the plan."""
    stages = {"build_model": "prepare", "fetch_model": "prepare", "prepare_data": "prepare", "audit": "prepare"}
    jobs: dict[str, int] = {}
    for rule, count in counts.items():
        stage = stages.get(rule, rule.split("_")[0])
        if stage not in ("all", "total"):
            jobs[stage] = jobs.get(stage, 0) + count
    return jobs


def last_checkpoint(run: Path) -> int:
    """The step of the run's newest checkpoint: what it resumes from."""
    return max(int(path.name.removeprefix("step_")) for path in (run / "checkpoints").glob("step_*"))


def tree(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under `directory`: its size and mtime."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


# (the grid without Snakemake: tests/test_study_grid.py)


# --- Snakemake itself ----------------------------------------------------------------------------


def test_bad_study_config_stops_snakemake_before_any_job(tmp_path):
    config = json.loads(json.dumps(REDUCED))
    config["run"]["train"]["stepz"] = 3  # the JSON schema lets run sections through; sweep.study.grid does not
    result = snakemake(tmp_path, write_config(tmp_path, config))
    assert result.returncode != 0
    assert "run.train.stepz: unknown key" in result.stderr + result.stdout
    assert not (tmp_path / "results").exists()  # nothing ran

    config = json.loads(json.dumps(REDUCED))
    config["grid"]["placements"] = ["everywhere"]  # sweep.study.grid checks the names against the trainer's registries
    result = snakemake(tmp_path, write_config(tmp_path, config))
    assert result.returncode != 0 and "everywhere" in result.stderr + result.stdout
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("name, runs, suites, checkpoints", [
    ("paper", 3 * (3 * 3 * 4 + 1) * 3, 2, 0),  # models x (estimators x placements x betas + baseline) x seeds
    # 2 models x the paper's 7 objectives; in-domain, out-of-domain and countdown; every 50 steps of 420 and 520 too
    ("paper_offpolicy", 2 * 7, 3, 7 * (8 + 10)),
])
def test_paper_dry_run_lists_the_full_grid(tmp_path, name, runs, suites, checkpoints):
    start = time.perf_counter()
    result = snakemake(tmp_path, REPO / "workflow" / "config" / f"{name}.yaml", "-n", "--quiet", "rules")
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    counts = {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", result.stdout + result.stderr, re.M)}
    assert counts["train"] == runs
    assert counts["evaluate"] == (runs + checkpoints) * suites  # final models and checkpoints
    assert counts["fetch_model"] == len(yaml.safe_load((REPO / "workflow" / "config" / f"{name}.yaml").read_text())
                                        ["models"])
    # the dry run's plan (sweep.study.plan) counts the same
    assert planned_jobs(result.stdout) == snakemake_jobs(counts)
    assert not (tmp_path / "results").exists()
    print(f"{name}.yaml dry run: {elapsed:.1f} s")


STEPS, EVAL_EVERY = 30, 15  # the interrupted study's runs: 30 steps, checkpoints every 3, evaluated at 15


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_reduced_toy_study_interrupted_and_resumed(tmp_path, stop, prepared_toy_study):
    """Ctrl-C, or a hard kill of Snakemake and its jobs (the OOM killer, a closed login session),
    then the same command: only what is missing runs. After SIGKILL, Snakemake's lock is left behind
    and the same command used to fail with LockException until --unlock."""
    # Runs long enough to be caught mid-way: a toy step takes about 0.02 s, and with REDUCED's 6 steps a run's
    # last three (0.1 s) completed between the test's look and its kill in CI. Its models and data are REDUCED's.
    train = {**REDUCED["run"]["train"], "steps": STEPS}
    config = write_config(tmp_path, {**REDUCED, "run": {**REDUCED["run"], "train": train},
                                     "evaluate": {**REDUCED["evaluate"], "every": EVAL_EVERY}})
    from_prepared(tmp_path, prepared_toy_study)
    results = tmp_path / "results"
    log = (tmp_path / "first.log").open("w")
    process = subprocess.Popen([*SNAKEMAKE, *LOCAL, "--directory", str(tmp_path), "--configfile", str(config)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_sigint)
    # Interrupt once Snakemake has seen a training job finish and another run is mid-way (a checkpoint
    # written, not yet complete).
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline and process.poll() is None:
        runs = [results / "runs" / r for r in REDUCED_RUNS]
        midway = [r for r in runs if any((r / "checkpoints").glob("step_*")) and not (r / COMPLETE).exists()]
        if midway and jobs_finished((tmp_path / "first.log").read_text(), "train"):
            break
        time.sleep(0.1)
    assert process.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    os.killpg(process.pid, stop)  # to Snakemake and its running jobs
    assert process.wait(timeout=120) != 0
    log.close()
    interrupted = [r.name for r in midway if not (r / COMPLETE).exists()]
    assert interrupted
    first = (tmp_path / "first.log").read_text()
    # Finished is what has its COMPLETE: a run can complete in the instant of the kill, before Snakemake logs
    # its job as finished (CI saw it with SIGKILL); that run must not train again either.
    finished_before = {name: (results / "runs" / name / COMPLETE).stat().st_mtime_ns
                       for name in REDUCED_RUNS if (results / "runs" / name / COMPLETE).exists()}
    assert set(jobs_finished(first, "train")) <= set(finished_before), first[-3000:]
    assert finished_before and len(finished_before) < len(REDUCED_RUNS), first[-3000:]

    # The dry run says what the same command will do: each interrupted run resumes from its newest checkpoint.
    resumes = {name: last_checkpoint(results / "runs" / name) for name in interrupted}
    planned = snakemake(tmp_path, config, "-n")
    assert planned.returncode == 0, planned.stderr[-3000:]
    for name, step in resumes.items():
        assert f"    {name} resumes from step {step} of {STEPS}\n" in planned.stdout, planned.stdout[:3000]
    assert f", {len(finished_before)} finished\n" in planned.stdout
    second = snakemake(tmp_path, config)
    assert second.returncode == 0, second.stderr[-5000:]
    if stop == signal.SIGKILL:  # the dry run, or else the same command, releases the dead holder's lock
        released = planned.stderr + second.stderr
        assert f"snakemake pid {process.pid} on" in released and "its lock, if any, is released" in released
    retrained = jobs_run(second.stderr, "train")
    assert sorted(retrained) == sorted(set(REDUCED_RUNS) - set(finished_before))  # only what was missing
    for name, mtime in finished_before.items():
        assert (results / "runs" / name / COMPLETE).stat().st_mtime_ns == mtime
    for name in REDUCED_RUNS:  # every step exactly once, resumed or not
        assert [m["step"] for m in read_metrics(results / "runs" / name / "metrics.jsonl")] == list(range(STEPS))
    for name, step in resumes.items():  # cut off mid-way: resumed from its checkpoint, not started over
        assert f"resumed from checkpoint step_{step}" in (results / "logs" / "train" / f"{name}.log").read_text()

    for name in REDUCED_RUNS:
        final = json.loads((results / "eval" / name / "toy" / "metrics.json").read_text())
        assert final["tasks"]["arith"]["n"] == 20
        assert (results / "eval" / name / f"step_{EVAL_EVERY}" / "toy" / "metrics.json").is_file()
    table = (results / "tables" / "results.md").read_text()
    assert "k3-reward" in table and "k3-loss" in table and "no KL" in table
    assert "unbiased" in (results / "tables" / "gradient_audit.md").read_text()
    assert (results / "mlflow.db").is_file()
    figures = {p.name for p in (results / "figures").iterdir()}
    assert {"curves_toy-sft_beta0.1.png", "accuracy_vs_step_toy-sft_beta0.1.png"} <= figures
    assert "accuracy_vs_beta_toy-sft.png" not in figures  # one beta: nothing to draw against it
    tracked = json.loads((results / "tracking" / "toy-test.json").read_text())
    assert len(tracked["child_run_ids"]) == len(REDUCED_RUNS)

    # Finished is finished: nothing to do, even after the package's code and docs change.
    os.utime(REPO / "trainer" / "run" / "step.py")
    again = snakemake(tmp_path, config, "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
def test_reduced_toy_study_in_bundles_with_an_extra_axis_and_the_measured_objective(tmp_path, prepared_toy_study):
    """An async-level axis doubles the grid and keeps its first half's ids; two runs per training job and
    three evaluations per evaluation job: fewer processes, the same files; every run measures its
    objective; the report has the gap, the reference, the axis in rows and columns and its figures,
    and MLflow tags every run with it."""
    config = json.loads(json.dumps(REDUCED))
    config["grid"]["axes"] = {"train.async_level": [0, 1]}
    config["bundle"] = {"train": 2, "evaluate": 3}
    config["run"]["measure"] = {"prompts": 8, "samples": 4, "reference_samples": 8, "task_options": {"seed": 1}}
    path = write_config(tmp_path, config)
    from_prepared(tmp_path, prepared_toy_study)
    runs = REDUCED_RUNS + [name.replace("__s0", "__async1__s0") for name in REDUCED_RUNS]
    before = tree(tmp_path / "results")
    dry = snakemake(tmp_path, path, "-n")
    assert dry.returncode == 0 and tree(tmp_path / "results") == before, dry.stderr[-3000:]  # a dry run writes nothing
    assert all(f"results/runs/{name}" in dry.stdout + dry.stderr for name in runs)  # in the train jobs' plans
    done = snakemake(tmp_path, path)
    assert done.returncode == 0, done.stderr[-5000:]
    started = re.findall(r"^(?:local)?rule (\w+):", done.stderr, re.M)
    assert len({r for r in started if r.startswith("train_")}) == 4  # 8 runs, 2 per job
    assert len({r for r in started if r.startswith("evaluate_")}) == 6  # 16 evaluations, 3 per job
    results = tmp_path / "results"
    for name in runs:
        assert [m["step"] for m in read_metrics(results / "runs" / name / "metrics.jsonl")] == list(range(6))
        assert [m["step"] for m in read_metrics(results / "runs" / name / "objective.jsonl")] == [3, 6]  # every 3
        for where in ("toy", "step_3/toy"):
            scores = json.loads((results / "eval" / name / where / "metrics.json").read_text())
            assert scores["tasks"]["arith"]["n"] == 20
    async_level = yaml.safe_load((results / "runs" / runs[-1] / "config.yaml").read_text())["train"]["async_level"]
    assert async_level == 1
    table = (results / "tables" / "results.md").read_text()
    assert "| toy-sft | 0.1 | - | reference | 1 |" in table and "objective_gap = J* - J(pi)" in table
    assert re.search(r"^\| toy-sft \| 0.1 \| 1 \| k3-loss( †)? \| 1 \|", table, re.M)  # († : the tiny SFT is unstable)
    assert "| arith (async_level=0) | arith (async_level=1) |" in (results / "tables" / "results_by_async_level.md"
                                                                  ).read_text()
    rows = list(csv.DictReader((results / "tables" / "results.csv").open()))
    assert {r["task"] for r in rows} == {"arith", "objective_gap", "kl_to_ref", "reward"}
    assert {r["train.async_level"] for r in rows} == {"0", "1", "-"}  # "-": the reference's own row
    figures = results / "figures"
    assert (figures / "reward_vs_kl_toy-sft_async1.png").stat().st_size > 20_000
    assert {"accuracy_vs_async_level_toy-sft.png", "curves_toy-sft_beta0.1_async0.png",
            "accuracy_vs_step_toy-sft_beta0.1_async1.png"} <= {p.name for p in figures.iterdir()}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{results / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("klstudy/toy-test")
    tags = {r.data.tags["klstudy.run_id"]: r.data.tags for r in client.search_runs([experiment.experiment_id])
            if r.data.tags.get("klstudy.role") == "grid-point"}
    assert {name: tags[name]["klstudy.train.async_level"] for name in runs} == {
        name: "1" if "async1" in name else "0" for name in runs}
    again = snakemake(tmp_path, path, "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
