"""Each run's config as the file its training job reads (sweep.study.run_configs): the study's config of the
run exactly, written once, rewritten only when it changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from sweep.study import run_configs
from sweep.study.grid import load_study
from trainer import config as run_config

REPO = Path(__file__).resolve().parent.parent


def study(tmp_path, name="toy_offpolicy"):
    data = yaml.safe_load((REPO / "workflow" / "config" / f"{name}.yaml").read_text())
    return load_study({**data, "results": str(tmp_path / "results")})


def test_a_config_file_is_the_runs_config_and_is_written_once(tmp_path):
    toy = study(tmp_path)
    ids = [run.run_id for run in toy.runs]
    assert len(run_configs.write(toy, ids)) == len(ids)
    for run in toy.runs:  # the trainer reads the very config the study resolved
        path = run_configs.config_file(toy, run.run_id)
        assert path == tmp_path / "results" / "configs" / f"{run.run_id}.yaml"
        assert yaml.safe_load(path.read_text()) == run.config
        assert run_config.load(path) == run_config.from_dict(run.config)
    first = run_configs.config_file(toy, ids[0])
    os.utime(first, (1, 1))
    assert run_configs.write(toy, ids) == [] and first.stat().st_mtime == 1  # unchanged: not touched
    first.write_text("train: {steps: 1}\n")
    assert run_configs.write(toy, ids) == [first]


def test_train_runs_reads_config_files_and_checks_them_all_first(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("model: {path: some/model}\ntrain: {steps: 2}\n")
    bad.write_text("train: {stepz: 2}\n")
    refused = subprocess.run([sys.executable, "-m", "trainer", "train-runs", "--run", str(good), str(tmp_path / "a"),
                              "--run", str(bad), str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and f"--run {bad} {tmp_path / 'b'}: train.stepz: unknown key" in refused.stderr
    assert not (tmp_path / "a").exists()


def test_several_runs_in_one_job_of_several_processes_must_share_their_process_group(tmp_path):
    """Such runs share the job's process group, joined once: one device for them all, and no vLLM, whose
    shutdown after a run destroys that group. Refused before any run starts, saying what to do."""
    def train_runs(*engines_and_devices):
        plan = {str(tmp_path / f"r{i}"): ["model.path=some/model", f"rollout.engine={engine}", f"model.device={device}"]
                for i, (engine, device) in enumerate(engines_and_devices)}
        return subprocess.run([sys.executable, "-m", "trainer", "train-runs", "--plan", json.dumps(plan)],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"})

    on_vllm = train_runs(("hf", "cpu"), ("vllm", "cpu"))
    assert on_vllm.returncode == 2 and "destroys the processes' group" in on_vllm.stderr, on_vllm.stderr[-2000:]
    assert "bundle.train: 1" in on_vllm.stderr
    mixed = train_runs(("hf", "cpu"), ("hf", "cuda"))
    assert mixed.returncode == 2 and "on one device, and these ask for cpu, cuda" in mixed.stderr, mixed.stderr
    assert not any(tmp_path.iterdir())  # nothing started
