"""A finished study whose config changed, run for real: every changed evaluation setting stops the dry run naming
it, and after `--config rerun=changed` exactly those evaluations run again; a run directory deleted by hand has its
evaluations redone with it; a second study on the same results directory is refused, the first left as it was.
(The comparisons themselves, without Snakemake: tests/test_study_heals.py.)"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import WARM_START, built_once, cold_environment
from test_workflow import LOCAL, SNAKEMAKE, from_prepared, write_config

from trainer.run_files import COMPLETE

REPO = Path(__file__).resolve().parent.parent
QUICK = yaml.safe_load((REPO / "workflow" / "config" / "toy_quick.yaml").read_text())
STUDY = {**QUICK, "results": "results"}  # 4 points, each evaluated at step 3 and at the end: 8 evaluations
RUNS = ["toy-sft__k1-reward__b0.1__s0", "toy-sft__k3-reward__b0.1__s0", "toy-sft__k3-loss__b0.1__s0",
        "toy-sft__none__s0"]
EVALUATIONS = [f"{run}/{where}" for run in RUNS for where in ("step_3/toy", "toy")]


def snakemake(directory: Path, *args: str, override: dict | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    files = [directory / "study.yaml"]
    if override is not None:
        files.append(directory / "changed.yaml")
        files[-1].write_text(yaml.safe_dump(override))
    return subprocess.run([*SNAKEMAKE, *LOCAL, "--directory", str(directory), "--configfile", *map(str, files), *args],
                          capture_output=True, text=True, timeout=900, env=env)


def digests(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="session")
def finished_quick_study(request, prepared_toy_study):
    """The quick toy study run to its end once for the session (its prepare stage copied from
    prepared_toy_study); each test works on a copy."""
    def run(path: Path) -> None:
        path.mkdir()
        write_config(path, STUDY)
        from_prepared(path, prepared_toy_study)
        done = snakemake(path)
        assert done.returncode == 0, done.stderr[-4000:]

    return built_once(request, "finished-quick-study", run)


@pytest.fixture
def finished(tmp_path, finished_quick_study):
    shutil.copytree(finished_quick_study, tmp_path, dirs_exist_ok=True, symlinks=True)
    return tmp_path


def data_name(study: dict) -> str:
    from sweep.study.grid import load_study

    return str(load_study(study).data_file("heldout"))


# A changed evaluation setting (an override file merged over the study) and what the stop says of it.
CHANGES = {
    "samples": ({"evaluate": {"samples": 3}}, "evaluate.samples: 2 there, 3 now"),
    "temperature": ({"evaluate": {"temperature": 0.7}}, "evaluate.temperature: 1.0 there, 0.7 now"),
    "top_p": ({"evaluate": {"top_p": 0.9}}, "evaluate.top_p: 1.0 there, 0.9 now"),
    "limit": ({"evaluate": {"limit": 10}}, "evaluate.limit: null there, 10 now"),
    "max_gen_toks": ({"evaluate": {"max_gen_toks": 3}}, "evaluate.max_gen_toks: null there, 3 now"),
    "backend": ({"evaluate": {"backend": "vllm"}}, "evaluate.backend: hf there, vllm now"),
    "data": ({"data": {"heldout": {"n": 10}}},
             f"evaluate.data.arith: {data_name(STUDY)} there, "
             f"{data_name({**STUDY, 'data': {'heldout': {**STUDY['data']['heldout'], 'n': 10}}})} now"),
}


@pytest.mark.parametrize("setting", list(CHANGES))
def test_a_changed_evaluation_setting_stops_the_study_and_rerun_changed_redoes_exactly_those(finished, setting):
    override, said = CHANGES[setting]
    runs_before, model_before = digests(finished / "results" / "runs"), digests(finished / "results" / "models")
    stopped = snakemake(finished, "-n", override=override)
    message = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0 and f"8 evaluations were made otherwise than the study says now ({said}; " in \
        message, message[-3000:]
    assert "--config rerun=changed" in message

    if setting == "backend":  # lm-eval's vllm backend cannot run beside vLLM's CPU build: the plan says it all
        planned = snakemake(finished, "-n", "--config", "rerun=changed", override=override)
        assert planned.returncode == 0, planned.stderr[-3000:]
        assert f"0 point(s) and 8 evaluation(s) would be discarded and run again: {', '.join(EVALUATIONS)}" in \
            planned.stderr
        assert re.search(r"^    evaluate, toy-sft: 3 jobs$", planned.stdout, re.M) and "train, " not in planned.stdout
        assert "runs: 0 start fresh, 0 resume from a checkpoint, 4 finished" in planned.stdout
        return
    rerun = snakemake(finished, "--config", "rerun=changed", override=override)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert (f"klstudy rerun: 0 point(s) and 8 evaluation(s) discarded, to run again from scratch: "
            f"{', '.join(EVALUATIONS)}") in rerun.stderr
    assert not re.search(r"^(local)?rule (train|build_model)", rerun.stderr, re.M)
    assert digests(finished / "results" / "runs") == runs_before  # no run trained or touched
    assert digests(finished / "results" / "models") == model_before
    for key in EVALUATIONS:
        made = json.loads((finished / "results" / "eval" / key / "metrics.json").read_text())["provenance"]
        now = said.rsplit(", ", 1)[1].removesuffix(" now")
        value = made["data"]["arith"]["source"] if setting == "data" else made["settings"][setting]
        assert json.dumps(value) == now or value == now
    [moved] = (finished / "results" / "discarded").iterdir()
    assert sorted(str(p.parent.relative_to(moved / "eval")) for p in (moved / "eval").rglob("metrics.json")) == \
        sorted(EVALUATIONS)
    assert "Nothing to be done" in snakemake(finished, "-n", override=override).stdout


def test_a_run_directory_deleted_by_hand_is_trained_again_and_its_evaluations_redone(finished):
    results = finished / "results"
    kept = {run: digests(results / "runs" / run) for run in RUNS[1:]}
    old = (results / "eval" / RUNS[0] / "toy" / "metrics.json").read_text()
    shutil.rmtree(results / "runs" / RUNS[0])
    again = snakemake(finished)
    assert again.returncode == 0, again.stderr[-4000:]
    assert (f"klstudy: 2 evaluation(s) scored a model that is no longer there (its run is not finished, or was "
            f"trained again since): moved to {Path('results') / 'discarded'}/ and evaluated again with it: "
            f"{RUNS[0]}/step_3/toy, {RUNS[0]}/toy") in again.stderr
    assert (results / "runs" / RUNS[0] / COMPLETE).is_file()
    assert {run: digests(results / "runs" / run) for run in RUNS[1:]} == kept
    made = json.loads((results / "eval" / RUNS[0] / "toy" / "metrics.json").read_text())["provenance"]
    assert made["model"]["sha256"] == hashlib.sha256((results / "runs" / RUNS[0] / COMPLETE).read_bytes()).hexdigest()
    assert made != json.loads(old)["provenance"]
    assert "Nothing to be done" in snakemake(finished, "-n").stdout


def test_every_output_names_the_digest_the_study_resolves_for_it(finished_quick_study):
    """The study's resolved run (`sweep status --json`), its COMPLETE and the report's provenance.csv carry one
    config digest; each evaluation's metrics.json, its recomputation and provenance.csv one digest of what made
    it, whose model part is COMPLETE's content, so that an evaluation names its run's config too."""
    from eval import provenance

    results = finished_quick_study / "results"
    shown = subprocess.run([sys.executable, "-m", "sweep", "status", "--configfile", "study.yaml", "--json"],
                           cwd=finished_quick_study, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    resolved = {point["run_id"]: point["digest"] for point in json.loads(shown.stdout)}
    assert sorted(resolved) == sorted(RUNS) and len(set(resolved.values())) == len(RUNS)
    rows = list(csv.DictReader((results / "tables" / "provenance.csv").open()))
    for run in RUNS:
        assert json.loads((results / "runs" / run / COMPLETE).read_text())["config_sha256"] == resolved[run]
    assert {row["run_id"]: row["config_sha256"] for row in rows} == resolved
    listed = {f"{row['run_id']}/{row['evaluation']}": row["evaluation_sha256"] for row in rows if row["evaluation"]}
    assert sorted(listed) == sorted(EVALUATIONS)
    for key, listed_digest in listed.items():
        made = json.loads((results / "eval" / key / "metrics.json").read_text())["provenance"]
        complete = (results / "runs" / key.split("/")[0] / COMPLETE).read_bytes()
        assert made["model"]["sha256"] == hashlib.sha256(complete).hexdigest()
        assert made["digest"] == provenance.digest(made) == listed_digest


def test_a_second_shipped_study_on_the_same_results_directory_is_refused_and_the_first_kept(finished):
    """The toy study (toy.yaml) pointed at the quick study's results directory: refused before any job, naming both;
    the quick study's table, job ledger and reference model are as they were, and its dry run has nothing to do."""
    results = finished / "results"
    before = {part: digests(results / part) for part in ("tables", ".jobs", "models")}
    toy = yaml.safe_load((REPO / "workflow" / "config" / "toy.yaml").read_text())
    (finished / "toy.yaml").write_text(yaml.safe_dump({**toy, "results": "results"}))
    refused = subprocess.run([*SNAKEMAKE, *LOCAL, "--directory", str(finished), "--configfile",
                              str(finished / "toy.yaml")], capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0
    assert ("results: results holds the results of study toy-quick, not toy: two studies in one directory would "
            "mix their runs") in refused.stderr, refused.stderr[-3000:]
    assert {part: digests(results / part) for part in ("tables", ".jobs", "models")} == before
    assert "Nothing to be done" in snakemake(finished, "-n").stdout


def test_the_shipped_studies_have_results_directories_of_their_own():
    """No two shipped study configs (and the override files with their base) share a results directory."""
    from sweep.study import configfiles
    from sweep.study.grid import load_study

    config = REPO / "workflow" / "config"
    grown = {"toy_seeds.yaml": ["toy.yaml"], "toy_betas.yaml": ["toy.yaml"], "toy_quick_seed1.yaml": ["toy_quick.yaml"],
             "smol_cpu.yaml": ["smol.yaml"], "smol_mps.yaml": ["smol.yaml"], "paper_cpu.yaml": ["paper.yaml"],
             "paper_cpu_hosts.yaml": ["paper.yaml", "paper_cpu.yaml"],
             "toy_offpolicy_behaviour.yaml": ["toy_offpolicy.yaml"]}
    studies = {}
    for path in sorted(config.glob("*.yaml")):
        if path.name == "schema.yaml":
            continue
        files = [*(config / base for base in grown.get(path.name, [])), path]
        study = load_study(configfiles.read(files))
        studies.setdefault(study.results, set()).add(study.name)
    assert all(len(names) == 1 for names in studies.values()), studies


def test_the_study_run_cold_as_a_users_jobs_start_gives_the_warm_runs_table(tmp_path, finished_quick_study,
                                                                              prepared_toy_study):
    """Every other study of the suite forks its jobs from a warm process (tests/warm_start: the libraries imported,
    gc frozen). This one starts each job as a user's starts, a fresh interpreter that imports everything: a
    failure only a cold start has (an import order, a signal during the imports) fails here, and the table is
    the warm run's, digit for digit."""
    write_config(tmp_path, STUDY)
    from_prepared(tmp_path, prepared_toy_study)
    assert str(WARM_START) in os.environ["PYTHONPATH"].split(os.pathsep)  # the suite's jobs start warm, these not:
    done = snakemake(tmp_path, env=cold_environment(dict(os.environ)))
    assert done.returncode == 0, done.stderr[-4000:]
    table = "results/tables/results.md"
    assert (tmp_path / table).read_text() == (finished_quick_study / table).read_text()
