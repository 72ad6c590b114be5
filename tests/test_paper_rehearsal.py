"""The paper study's CPU-size override (workflow/config/paper_cpu.yaml) keeps the paper's study and shrinks
only its size. The rehearsal itself, paper.yaml with this override through profiles/slurm against a real hub,
runs across a cluster of hosts on this machine: tests/test_cluster_hosts.py."""

from __future__ import annotations

from pathlib import Path

import yaml

from sweep.study import configfiles
from sweep.study.grid import load_study

REPO = Path(__file__).resolve().parent.parent
CONFIGS = [REPO / "workflow" / "config" / "paper.yaml", REPO / "workflow" / "config" / "paper_cpu.yaml"]
HOSTS = REPO / "workflow" / "config" / "paper_cpu_hosts.yaml"
MODELS = ("Qwen2.5-7B", "Llama-3.1-8B-Instruct", "Qwen3-4B-Instruct-2507")


def paper_cpu(*more: Path):
    return load_study(configfiles.read([*CONFIGS, *more]))  # merged as Snakemake merges --configfile


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


def test_the_hosts_override_trains_one_model_over_two_nodes_and_changes_no_run():
    small, hosts = paper_cpu(), paper_cpu(HOSTS)
    assert [(run.run_id, run.config) for run in hosts.runs] == [(run.run_id, run.config) for run in small.runs]
    nodes = {name: hosts.resources_for("train", name).get("nodes", 1) for name in MODELS}
    assert nodes == {"Qwen2.5-7B": 2, "Llama-3.1-8B-Instruct": 1, "Qwen3-4B-Instruct-2507": 1}
