"""The paper study's own path, rehearsed: workflow/config/paper.yaml as it is, plus its CPU override
(paper_cpu.yaml), through profiles/slurm on the local SLURM cluster, against a real hub server on
127.0.0.1 (tests/hub_server.py). Snakemake's own process fetches SmolLM2 and the hub data sets in their
real layouts (MATH-lighteval, MATH-500, the three MMLU college subjects); every job then runs offline;
the runs train, are measured, evaluated in-domain (MATH-500, MATH^2 from data/math2.jsonl) and
out-of-domain (MMLU) with the study's lm-eval tasks, tracked and reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import test_workflow
import yaml

from eval.suites import IN_DOMAIN, OUT_OF_DOMAIN
from sweep.checks import merge
from sweep.grid import load_study
from trainer.run_files import COMPLETE, read_metrics

REPO = Path(__file__).resolve().parent.parent
CONFIGS = [REPO / "workflow" / "config" / "paper.yaml", REPO / "workflow" / "config" / "paper_cpu.yaml"]
SNAKEMAKE = [*test_workflow.SNAKEMAKE, "--profile", str(REPO / "profiles" / "slurm")]
MODELS = ("Qwen2.5-7B", "Llama-3.1-8B-Instruct", "Qwen3-4B-Instruct-2507")


def paper_cpu():
    return load_study(merge(*(yaml.safe_load(path.read_text()) for path in CONFIGS)))


def test_the_override_keeps_the_papers_study_and_shrinks_only_its_size():
    paper, small = load_study(yaml.safe_load(CONFIGS[0].read_text())), paper_cpu()
    assert small.name == paper.name and list(small.models) == list(paper.models) == list(MODELS)
    assert {model.path for model in small.models.values()} == {"HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert small.evaluate["suites"] == paper.evaluate["suites"] and small.eval_data() == paper.eval_data()
    assert sorted(run.run_id for run in small.runs) == sorted(
        f"{model}__{point}" for model in MODELS for point in ("k1-reward__b0.1__s0", "none__s0"))
    assert {run.run_id for run in small.runs} <= {run.run_id for run in paper.runs}  # the paper's own ids
    ours, theirs = small.runs[0].config, paper.run(small.runs[0].run_id).config
    assert ours["task"]["options"]["path"] == theirs["task"]["options"]["path"] == "DigitalLearningGmbH/MATH-lighteval"
    assert ours["objective"] == theirs["objective"]  # the objective is the paper's: RLOO, its aggregation


def math2_records(path: Path) -> None:
    """MATH^2 has no hub copy: the study reads it from the file its docs name (problem, answer)."""
    path.parent.mkdir(parents=True)
    rows = [{"problem": f"What is ${a} + {a}$?", "answer": str(2 * a)} for a in range(1, 5)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
def test_the_paper_study_at_cpu_size_runs_through_slurm_with_offline_jobs(slurm, hub, tmp_path):
    math2_records(tmp_path / "data" / "math2.jsonl")
    env = {**hub.env(tmp_path / "hf"), "PYTHONUNBUFFERED": "1",  # torch's threads as the suite's (make test: 1)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [*SNAKEMAKE, "--directory", str(tmp_path), "--configfile", *map(str, CONFIGS)]
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=env)
    try:
        output, _ = process.communicate(timeout=2400)  # a hang detector: 9-25 min in CI, beside the other worker
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)  # Snakemake cancels its SLURM jobs
        output, _ = process.communicate(timeout=120)
        pytest.fail(f"the rehearsal ran past 40 minutes:\n{output[-5000:]}")
    print(f"the paper study at CPU size, through SLURM: {time.monotonic() - started:.0f} s")
    assert process.returncode == 0, output[-6000:]
    # fetched by Snakemake's own process, then the jobs ran offline (tests/test_offline_jobs.py checks a
    # job's environment; here: nothing was fetched by a job, all the hub's content came before)
    for need in ("model HuggingFaceTB/SmolLM2-135M-Instruct", "dataset DigitalLearningGmbH/MATH-lighteval",
                 "dataset HuggingFaceH4/MATH-500", "dataset cais/mmlu:college_physics"):
        assert f"klstudy fetch: {need}" in output, output[-3000:]
    results = tmp_path / "results" / "paper-cpu"
    for run in paper_cpu().runs:
        directory = results / "runs" / run.run_id
        assert (directory / COMPLETE).is_file(), run.run_id
        assert [m["step"] for m in read_metrics(directory / "metrics.jsonl")] == [0]
        assert read_metrics(directory / "objective.jsonl"), run.run_id  # measured on MATH's test split
        for suite, tasks in (("in_domain", IN_DOMAIN), ("out_of_domain", OUT_OF_DOMAIN)):
            scored = json.loads((results / "eval" / run.run_id / suite / "metrics.json").read_text())["tasks"]
            assert set(scored) == set(tasks), (run.run_id, suite)
            assert all(task["n"] >= 1 and 0 <= task["value"] <= 1 for task in scored.values())
    table = (results / "tables" / "results.md").read_text()
    assert all(model in table for model in MODELS) and "math500" in table and "mmlu_college_biology" in table
    assert (results / "mlflow.db").is_file()
