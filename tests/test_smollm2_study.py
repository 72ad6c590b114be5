"""smol.yaml's CPU smoke variant through Snakemake: SmolLM2-135M-Instruct imported by the prepare step,
trained, evaluated in-domain and out-of-domain with lm-eval, tracked and reported, for real."""

import json
import os
import signal
import subprocess

import pytest
from test_workflow import LOCAL, REPO, SNAKEMAKE

from sweep.study import configfiles
from sweep.study.grid import load_study
from trainer.run_files import read_metrics

CONFIGS = [REPO / "workflow" / "config" / "smol.yaml", REPO / "workflow" / "config" / "smol_cpu.yaml"]
RUNS = ["SmolLM2-135M-Instruct__k1-reward__b0.1__s0", "SmolLM2-135M-Instruct__k3-loss__b0.1__s0",
        "SmolLM2-135M-Instruct__none__s0"]


@pytest.mark.slow
def test_the_smol_studys_cpu_smoke_variant_runs_end_to_end(smollm2, tmp_path):
    """The session imported SmolLM2 into the cache; the prepare step imports it again from the cached GGUF
    (no download) into the study's results."""
    command = [*SNAKEMAKE, *LOCAL, "--directory", str(tmp_path), "--configfile", *map(str, CONFIGS)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        _, stderr = process.communicate(timeout=3000)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # Snakemake and its jobs: none left running
        process.communicate()
        raise
    assert process.returncode == 0, stderr[-5000:]
    results = tmp_path / "results" / "smol-cpu"
    study = load_study(configfiles.read(CONFIGS))
    imported = json.loads((tmp_path / study.model_dir("SmolLM2-135M-Instruct") / "klstudy_import.json").read_text())
    assert imported["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    for name in RUNS:
        run = results / "runs" / name
        assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [0, 1]
        assert [m["step"] for m in read_metrics(run / "objective.jsonl")] == [2]  # measured on held-out prompts
        for suite in ("arith_natural", "countdown_natural"):  # in-domain, out-of-domain
            task = json.loads((results / "eval" / name / suite / "metrics.json").read_text())["tasks"][suite]
            assert task["n"] == 4 and 0 <= task["value"] <= 1
    table = (results / "tables" / "results.md").read_text()
    assert "k1-reward" in table and "k3-loss" in table and "no KL" in table and "arith_natural" in table
    assert (results / "mlflow.db").is_file()
