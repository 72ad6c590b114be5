"""Objectives that extend from outside: a package's entry point in `klstudy.objectives` registers choices
that every registry reader then sees (trainer.objective.plugins). The package is examples/my-objectives,
the one docs/guides/own_objective.md walks through."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_workflow import LOCAL, SNAKEMAKE

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "my-objectives"
PLUGIN = (EXAMPLE / "my_objectives.py").read_text()

CHECK = '''
from trainer.objective import estimators, plugins
from trainer.objective.objective_config import ObjectiveConfig

print(plugins.load(), plugins.load())
print("k1x2" in estimators.sampled_estimators())
print(ObjectiveConfig(estimator="k1x2", placement="loss", kl_loss_ratio="half", loss_agg="batch-sum").loss_agg)
'''


def _install(tmp_path: Path, module: str, body: str, target: str) -> dict[str, str]:
    """A package `module` whose entry point `target` is in klstudy.objectives, on a PYTHONPATH of its own."""
    (tmp_path / f"{module}.py").write_text(body)
    info = tmp_path / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[klstudy.objectives]\n{module} = {target}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


def test_a_plugins_choices_are_registered_before_any_registry_is_read(tmp_path):
    env = _install(tmp_path, "my_objectives", PLUGIN, "my_objectives")
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["('my_objectives',) ('my_objectives',)", "True", "batch-sum"]


def test_a_plugin_that_fails_to_load_is_one_clear_error(tmp_path):
    env = _install(tmp_path, "broken_objectives", "raise ImportError('no such thing')\n", "broken_objectives")
    done = subprocess.run([sys.executable, "-m", "trainer", "audit", "--presets", "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: klstudy.objectives entry point broken_objectives (broken_objectives): "
                                   "ImportError: no such thing")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """examples/my-objectives installed by pip (into a directory of its own, put on PYTHONPATH)."""
    site = tmp_path_factory.mktemp("plugin") / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(EXAMPLE)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "OMP_NUM_THREADS": "1"}


def test_the_example_packages_own_tests_pass_once_installed(installed):
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
                          env=installed, capture_output=True, text=True, timeout=300, cwd=EXAMPLE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout


@pytest.mark.slow
def test_an_installed_packages_estimator_is_audited_and_trains_in_a_study(installed, warm_model, tmp_path):
    """The guide's study axis, through Snakemake and every job it starts: the audit finds the verdicts the
    package registered, the run trains with k1x2 (its logged kl_k1x2 is twice kl_k1), and the report has
    its row."""
    study = {
        "study": "plugin", "results": "results", "models": {"toy": {"path": str(warm_model)}},
        "grid": {"estimators": ["k1x2"], "placements": ["reward"], "betas": [0.1], "seeds": [0], "baseline": False},
        "run": {"task": {"name": "arithmetic", "options": {"max_operand": 9}}, "rollout": {"max_new_tokens": 4},
                "train": {"steps": 3, "prompts_per_step": 4, "group_size": 4}},
        "data": {"heldout": {"task": "arithmetic", "options": {"max_operand": 9, "seed": 1}, "n": 10}},
        "evaluate": {"suites": ["toy"], "samples": 2, "data": {"arith": "heldout"}},
    }
    (tmp_path / "study.yaml").write_text(json.dumps(study))
    done = subprocess.run([*SNAKEMAKE, *LOCAL, "--directory", str(tmp_path),
                           "--configfile", str(tmp_path / "study.yaml")], env=installed, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    results = tmp_path / "results"
    with (results / "audit" / "gradient_audit.csv").open() as table:
        rows = [row for row in csv.DictReader(table) if row["estimator"] == "k1x2"]
    assert rows, "the audit has no row for the plugin's estimator"
    on_policy = {row["placement"]: row for row in rows if row["sampling"] == "on-policy" and
                 row["kl_loss_ratio"] in ("", "-", "none")}
    assert {p: on_policy[p]["verdict"] for p in ("reward", "loss", "reward+loss")} == {
        "reward": "scaled", "loss": "zero", "reward+loss": "scaled"}
    run = results / "runs" / "toy__k1x2-reward__b0.1__s0"
    assert (run / "COMPLETE").exists()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert line["kl_k1x2"] == pytest.approx(2 * line["kl_k1"], rel=1e-6)
    assert "k1x2" in (results / "tables" / "results.md").read_text()
