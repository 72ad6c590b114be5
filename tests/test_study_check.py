"""A study config is checked whole before anything runs (sweep.study.study_check, sweep.study.config_schema): each
problem in one line that names the key; a YAML error with its file, line and column; model paths and
devices against GPUs; and the dry run's plan (sweep.study.plan): each job's resources and sbatch options,
and where each run starts."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import test_workflow
import yaml
from test_workflow import planned_jobs, snakemake_jobs

from sweep.study import jobs
from sweep.study.config_schema import schema_problem
from sweep.study.grid import StudyError, load_study
from sweep.study.plan import job_groups, run_state, sbatch_options, slurm_defaults
from sweep.study.study_check import check_study, preflight
from trainer.run_files import COMPLETE

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "workflow" / "config" / "schema.yaml"
TOY = yaml.safe_load((REPO / "workflow" / "config" / "toy.yaml").read_text())
SNAKEMAKE = [*test_workflow.SNAKEMAKE, "--cores", "1"]


def toy(**sections) -> dict:
    """toy.yaml with whole top-level sections replaced (None drops one)."""
    config = copy.deepcopy(TOY)
    for name, value in sections.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = value
    return config


def dry_run(directory: Path, config: dict | str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`snakemake -n` of a study config (a dict, or the text of a config file) in `directory`."""
    path = directory / "study.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    return subprocess.run([*SNAKEMAKE, "--directory", str(directory), "--configfile", str(path), "-n", *args],
                          capture_output=True, text=True, timeout=120, env=os.environ | (env or {}))


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("study config: ")]


# --- through Snakemake: what a user sees -------------------------------------------------------------


def test_malformed_yaml_names_the_file_line_and_column(tmp_path):
    """It said `Config file is not valid JSON or YAML. In case of YAML, make sure to not mix whitespace
    and tab indentation.`: no file, no line, and a wrong hint."""
    result = dry_run(tmp_path, "study: x\nmodels:\n  a: {path: foo\n grid: [\n")
    assert result.returncode != 0
    assert error_lines(result) == [
        f"study config: {tmp_path / 'study.yaml'}, line 4, column 6: expected ',' or '}}', but got ':' (while "
        "parsing a flow mapping, from line 3, column 6; fix the YAML there)"], result.stderr
    assert "tab indentation" not in result.stderr
    tabbed = dry_run(tmp_path, "study: x\nmodels:\n\ta: {path: foo}\n")
    assert error_lines(tabbed) == [f"study config: {tmp_path / 'study.yaml'}, line 3, column 1: found character "
                                   "'\\t' that cannot start any token (indent with spaces: YAML allows no tabs)"]


def test_a_typo_outside_run_names_the_key_in_one_line(tmp_path):
    """`evalute:` gave jsonschema's ValidationError and a 225-line dump of the schema."""
    config = toy(evaluate=None, evalute=TOY["evaluate"])
    result = dry_run(tmp_path, config)
    assert result.returncode != 0 and not (tmp_path / "results").exists()
    assert error_lines(result) == ["study config: evalute: unknown key (known: study, results, models, grid, run, "
                                   "data, evaluate, tracking, resources, bundle, budget)"]
    assert len((result.stdout + result.stderr).splitlines()) < 8, result.stderr


def test_a_missing_local_model_stops_the_study_before_any_job(tmp_path):
    """It passed validation and the dry run, and failed only in fetch_model (on SLURM: after queueing)."""
    result = dry_run(tmp_path, toy(models={"mine": {"path": "./models/mine"}}))
    assert result.returncode != 0 and not (tmp_path / "results").exists()
    assert error_lines(result) == [
        f"study config: models.mine.path: ./models/mine does not exist (give a directory that save_pretrained "
        f"wrote, relative to the study's directory {tmp_path}, or a hub id such as Qwen/Qwen2.5-7B)"]


def test_cuda_jobs_without_a_gpu_stop_the_study_and_idle_gpus_are_warned_of(tmp_path):
    """run.model.device cuda gave the evaluate jobs --device=cuda with the default 0 GPUs; gpus: 1 on cpu
    jobs passed silently."""
    cuda = toy(run={**TOY["run"], "model": {"device": "cuda"}}, resources={"train": {"gpus": 1}})
    result = dry_run(tmp_path, cuda)
    assert result.returncode != 0
    assert error_lines(result) == [
        "study config: resources.evaluate.gpus: 0, but the evaluate jobs of toy-sft run on cuda (run.model.device) "
        "(on a cluster they get no GPU and fail as they start: set resources.evaluate.gpus: 1)"]
    idle = dry_run(tmp_path, toy(resources={"train": {"gpus": 1}}), "--quiet")
    assert idle.returncode == 0, idle.stderr[-2000:]
    assert ("warning: study config: resources.train.gpus: 1, but the train jobs of toy-sft run on cpu "
            "(run.model.device) (on a cluster each job holds 1 GPU it never uses: set run.model.device: cuda, or "
            "resources.train.gpus: 0)") in idle.stderr.splitlines()


def test_the_dry_run_shows_each_jobs_sbatch_options_and_where_each_run_starts(tmp_path):
    """The dry run showed no partition or account, and a killed study's runs only as missing COMPLETE."""
    runs = tmp_path / "results" / "runs"
    killed = runs / "toy-sft__k3-loss__b0.1__s2" / "checkpoints"
    (killed / "step_30" / "model").mkdir(parents=True)
    (killed / "step_30" / "model" / "weights").write_text("w")
    (killed / "step_30" / "manifest.json").write_text(json.dumps({"step": 30, "files": {"model/weights": 1}}))
    (killed / "step_40").mkdir()  # cut off while it was written: no manifest
    (runs / "toy-sft__none__s0").mkdir()
    (runs / "toy-sft__none__s0" / COMPLETE).write_text("{}\n")
    result = dry_run(tmp_path, toy(), "--quiet", "rules",
                     env={"SNAKEMAKE_SUBMITIT_PARTITION": "gpu", "SNAKEMAKE_SUBMITIT_ACCOUNT": "lab"})
    assert result.returncode == 0, result.stderr[-2000:]
    counts = {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", result.stdout, re.M)}
    assert planned_jobs(result.stdout) == snakemake_jobs(counts) == {"prepare": 3, "train": 4, "evaluate": 2,
                                                                     "track": 1, "report": 1}  # bundles of 8 and 16
    plan = result.stdout[:result.stdout.index("  runs:") + 200]
    assert "partition gpu (from SNAKEMAKE_SUBMITIT_PARTITION); account lab (from SNAKEMAKE_SUBMITIT_ACCOUNT)" in plan
    assert ("    train, toy-sft: 4 jobs\n      resources cpus 1, mem_mb 2000, runtime 30, gpus 0\n"
            "      sbatch --cpus-per-task=1 --mem=2000M --time=30 --partition=gpu --account=lab\n") in plan
    assert ("  runs: 28 start fresh, 1 resume from a checkpoint, 1 finished\n"
            "    toy-sft__k3-loss__b0.1__s2 resumes from step 30 of 150\n") in plan
    # the budget: the resumed run's 120 steps and 28 x 150; no step logged and no estimate, so unknown
    assert ("  budget (the work left; a job's GPUs x its hours):\n"
            "    train, toy-sft: 29 runs, 4,320 steps left: unknown (no run of this model has logged a step yet: "
            "set budget.step_seconds to price it)\n"
            "    study: training unknown (no step cost for toy-sft)\n") in result.stdout


# --- the checks themselves ----------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    ({"grid": {**TOY["grid"], "estimator": "k1"}},
     "grid.estimator: unknown key (known: estimators, placements, betas, seeds, baseline, axes, include, exclude)"),
    ({"models": {"x": {"path": "a", "build": {"toy": {}}}}},
     "models.x: give exactly one of path (a local directory or hub id), build and gguf"),
    ({"models": {"toy-sft": {"build": {"toy": {}, "sft": {"steps": "many"}}}}},
     "models.toy-sft.build.sft.steps: got 'many' (expected a whole number >= 1)"),
    ({"evaluate": {**TOY["evaluate"], "top_p": 1.5}}, "evaluate.top_p: got 1.5 (expected a number > 0 and <= 1)"),
    ({"tracking": {"uri": 5}}, "tracking.uri: got 5 (expected a string, or null)"),
    ({"resources": {"train": {"slurm_partition": 5}}},
     "resources.train.slurm_partition: got 5 (expected a string)"),
])
def test_every_bad_key_is_one_line_that_names_it(change, message):
    with pytest.raises(StudyError) as error:
        check_study(toy(**change), SCHEMA)
    assert str(error.value) == message


def test_the_schema_alone_names_keys_too():
    """What sweep.study.grid also checks, the schema says in one line of its own (the order of the two checks
    decides whose words the user sees)."""
    assert schema_problem(toy(evalute={}), SCHEMA).startswith("evalute: unknown key (known: study, results,")
    assert schema_problem(toy(study=None), SCHEMA) == "study: required (expected a name: letters, digits and . _ + -)"
    assert schema_problem(toy(models={"x": {}}), SCHEMA) == "models.x: give exactly one of path, build and gguf"
    assert schema_problem(toy(grid={"include": [{"seeds": 3}]}), SCHEMA) == (
        "grid.include[0].seeds: unknown key (known: model, estimator, placement, beta, seed, a dotted run-config key "
        "such as train.lr)")
    assert schema_problem(toy(grid={"axes": {"train.lr": []}}), SCHEMA) == \
        "grid.axes.train.lr: got [] (expected a list of values, at least 1)"
    live = toy(tracking={"uri": "http://127.0.0.1:5000"})
    assert check_study(live, SCHEMA).tracking_uri == "http://127.0.0.1:5000"  # the key is allowed: live tracking
    for name in ("toy", "toy_offpolicy", "paper", "paper_offpolicy"):
        assert schema_problem(yaml.safe_load((REPO / "workflow" / "config" / f"{name}.yaml").read_text()), SCHEMA) \
            is None


def test_evaluate_has_no_default_and_its_absence_is_one_clear_error():
    """Without `evaluate` a study defaulted to the MATH suites and failed with `evaluate.data.math2:
    required`, though nothing asked for math2."""
    for config, key in ((toy(evaluate=None), "evaluate"), (toy(evaluate={"samples": 4}), "evaluate.suites")):
        with pytest.raises(StudyError) as error:
            load_study(config)
        assert str(error.value) == (
            f"{key}: required (the suites or tasks to evaluate every final model on: suites in_domain, out_of_domain, "
            "all, toy; tasks math500, math2, mmlu_college_physics, mmlu_college_chemistry, mmlu_college_biology, "
            "countdown, arith, arith_natural, countdown_natural; for example evaluate: {suites: [toy], data: "
            "{arith: <a data entry>}})")
    assert load_study(toy(evaluate={"suites": []})).evaluate["suites"] == []  # no evaluation: said, not defaulted


def test_local_model_paths_are_checked_and_hub_ids_fetched_unless_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StudyError, match=r"^models.mine.path: empty has no config.json: is it a saved HF model\? "):
        preflight(load_study(toy(models={"mine": {"path": "empty"}})))
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.json").write_text("{}")
    assert preflight(load_study(toy(models={"mine": {"path": "saved"}}))) == []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = load_study(toy(models={"mine": {"path": "klstudy/not-cached"}}))
    assert preflight(hub) == [
        "note: study config: models.mine.path: model klstudy/not-cached is not in the Hugging Face cache yet: this "
        "run fetches it on this node before any job starts (the jobs run offline)"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(StudyError) as error:
        preflight(hub)
    assert str(error.value) == (
        "models.mine.path: model klstudy/not-cached is not in the Hugging Face cache, and HF_HUB_OFFLINE is set "
        "here, so this run cannot fetch it for its offline jobs (fetch on a node with the network: python -m sweep "
        "fetch --configfile STUDY.yaml)")


def test_devices_and_gpus_are_checked_per_model_and_rule():
    paper = load_study(yaml.safe_load((REPO / "workflow" / "config" / "paper.yaml").read_text()))
    assert not [line for line in preflight(paper) if line.startswith("warning")]  # 8 or 4 GPUs to train, 1 to evaluate
    config = toy(run={**TOY["run"], "model": {"device": "cuda"}},
                 models={"toy-sft": {**TOY["models"]["toy-sft"], "resources": {"evaluate": {"gpus": 1}}}})
    with pytest.raises(StudyError, match=r"^resources.train.gpus: 0, but the train jobs of toy-sft run on cuda "
                                         r"\(run.model.device\) .* set resources.train.gpus: 1, or more for training"):
        preflight(load_study(config))
    config["resources"] = {"train": {"gpus": 2}, "evaluate": {"gpus": 2}}
    config["models"]["toy-sft"]["resources"]["evaluate"]["gpus"] = 2
    assert preflight(load_study(config)) == [
        "warning: study config: models.toy-sft.resources.evaluate.gpus: 2, but an evaluation uses one device (on a "
        "cluster each of the evaluate jobs of toy-sft holds 1 GPU it never uses: set "
        "models.toy-sft.resources.evaluate.gpus: 1)"]


def test_a_training_step_that_asks_more_cpus_than_its_job_holds_stops_the_study_before_any_job(tmp_path,
                                                                                              monkeypatch):
    """On several nodes the trainer starts one process per GPU as one srun step, each with a CPU at least
    (trainer.launch): with fewer CPUs than GPUs per node the step asked more CPUs than its job holds, and
    srun refused it, on SLURM after the job's wait in the queue. The dry run said nothing."""
    result = dry_run(tmp_path, toy(resources={"train": {"nodes": 2, "gpus": 8, "cpus": 2}}))
    assert result.returncode != 0 and not (tmp_path / "results").exists()
    assert error_lines(result) == [
        "study config: resources.train.cpus: 2, but the train jobs of toy-sft start 8 processes per node (one per "
        "GPU) as one srun step on 2 nodes, each with a CPU at least, and hold 2 CPUs per node: srun would refuse "
        "the step, on SLURM after the job's wait in the queue (set resources.train.cpus: 8 or more)"]
    monkeypatch.chdir(tmp_path)
    own = toy(models={"toy-sft": {**TOY["models"]["toy-sft"], "resources": {"train": {"nodes": 2, "gpus": 4}}}},
              resources={"train": {"tasks": 2}})  # 2 tasks of 1 CPU per node for 4 processes
    with pytest.raises(StudyError, match=r"^models.toy-sft.resources.train.cpus: 1, but .* start 4 processes per "
                                         r"node .* hold 2 CPUs per node: .*set models.toy-sft.resources.train.cpus: 2"):
        preflight(load_study(own))
    for enough in ({"nodes": 2, "gpus": 8, "cpus": 8}, {"nodes": 1, "gpus": 8, "cpus": 2}, {"nodes": 2, "tasks": 4}):
        preflight(load_study(toy(resources={"train": enough})))  # one node with its GPUs: no srun step


# --- the plan ---------------------------------------------------------------------------------------


def test_slurm_settings_come_from_the_command_line_else_the_environment():
    argv = ["snakemake", "--submitit-account=cli-lab", "--submitit-qos", "high"]
    environ = {"SNAKEMAKE_SUBMITIT_PARTITION": "gpu", "SNAKEMAKE_SUBMITIT_ACCOUNT": "env-lab"}
    assert slurm_defaults(argv, environ) == {"partition": ("gpu", "SNAKEMAKE_SUBMITIT_PARTITION"),
                                             "account": ("cli-lab", "--submitit-account"),
                                             "qos": ("high", "--submitit-qos")}
    own = {"cpus": 8, "gpus": 1, "mem_mb": 64000, "runtime": 240, "slurm_partition": "a100"}
    assert sbatch_options(own, {"partition": "gpu", "account": "lab"}) == \
        "--cpus-per-task=8 --gpus-per-node=1 --mem=64000M --time=240 --partition=a100 --account=lab"


def test_the_plans_job_counts_per_model_follow_resources_and_bundles(tmp_path):
    paper = load_study({**yaml.safe_load((REPO / "workflow" / "config" / "paper.yaml").read_text()),
                        "results": str(tmp_path)})
    groups = {what: count for what, count, _ in job_groups(paper, jobs.plan(paper, record=False))}
    assert groups == {"prepare": 1, "prepare, fetch_model": 3,  # the audit; a check of each model
                      "train, Qwen2.5-7B, Llama-3.1-8B-Instruct": 222,  # 8 GPUs each
                      "train, Qwen3-4B-Instruct-2507": 111,  # 4 GPUs
                      "evaluate, Qwen2.5-7B, Llama-3.1-8B-Instruct, Qwen3-4B-Instruct-2507": 666, "track": 1,
                      "report": 1}
    toy_study = load_study({**toy(), "results": str(tmp_path)})
    toy_groups = {what: count for what, count, _ in job_groups(toy_study, jobs.plan(toy_study, record=False))}
    assert toy_groups == {"prepare": 3, "train, toy-sft": 4, "evaluate, toy-sft": 2, "track": 1, "report": 1}
    for run in toy_study.runs[:9]:  # the work left: 21 runs in 3 jobs, 21 evaluations in 2
        (tmp_path / "runs" / run.run_id).mkdir(parents=True)
        (tmp_path / "runs" / run.run_id / COMPLETE).write_text("{}")
    toy_groups = {what: count for what, count, _ in job_groups(toy_study, jobs.plan(toy_study, record=False))}
    assert toy_groups == {"prepare": 3, "train, toy-sft": 3, "evaluate, toy-sft": 2, "track": 1, "report": 1}


def test_a_fetch_model_job_asks_slurm_for_a_model_check_not_a_prepare_job(tmp_path):
    """fetch_model only checks that a model loads (its tokenizer; Snakemake's own process fetched it before any
    job), yet it took the prepare jobs' resources: in paper.yaml a 32 GB, two-hour job per model. The plan and
    Snakemake's jobs agree on the small job, and the prepare jobs left keep theirs."""
    paper = yaml.safe_load((REPO / "workflow" / "config" / "paper.yaml").read_text())
    result = dry_run(tmp_path, paper)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("    prepare, fetch_model: 3 jobs\n      resources cpus 1, mem_mb 2000, runtime 15, gpus 0\n"
            "      sbatch --cpus-per-task=1 --mem=2000M --time=15\n") in result.stdout
    assert "    prepare: 1 job\n      resources cpus 4, mem_mb 32000, runtime 120, gpus 0\n" in result.stdout  # audit
    fetches = [block for block in re.split(r"\n(?=\[)", result.stdout) if "rule fetch_model:" in block]
    shown = [set(re.search(r"^    resources: (.*)$", block, re.M).group(1).split(", ")) for block in fetches]
    assert len(shown) == 3 and all({"runtime=15", "mem_mb=2000", "gpu=0"} <= each for each in shown), fetches
    assert not [block for block in fetches if "threads:" in block]  # one thread: Snakemake does not say it
    counted = dry_run(tmp_path, paper, "--quiet", "rules")
    counts = {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", counted.stdout, re.M)}
    assert planned_jobs(counted.stdout) == snakemake_jobs(counts) and counts["fetch_model"] == 3
    # a partition, account or QOS set for the prepare jobs is where a fetch_model job may run too
    lab = {**paper, "resources": {**paper["resources"], "prepare": {**paper["resources"]["prepare"],
                                                                    "slurm_partition": "cpu", "mem_mb": 1000}}}
    assert ("    prepare, fetch_model: 3 jobs\n      resources cpus 1, mem_mb 1000, runtime 15, gpus 0, "
            "slurm_partition cpu\n") in dry_run(tmp_path, lab).stdout  # never more than a prepare job's


def test_run_states(tmp_path):
    assert run_state(tmp_path / "absent") == ("fresh", None)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / COMPLETE).write_text("{}")
    assert run_state(tmp_path / "done") == ("finished", None)
    torn = tmp_path / "torn" / "checkpoints" / "step_10"
    torn.mkdir(parents=True)
    (torn / "manifest.json").write_text(json.dumps({"step": 10, "files": {"trainer_state.pt": 5}}))
    assert run_state(tmp_path / "torn") == ("fresh", None)  # its only checkpoint lacks a file: starts over


def test_a_profiles_settings_reach_the_plan_and_the_last_option_wins(tmp_path):
    """The plan reads the executor's settings as Snakemake does: the profile's config.yaml below the
    command line and the environment, and of two options the last."""
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "config.yaml").write_text("submitit-partition: big\nsubmitit-qos: low\n")
    argv = ["snakemake", "--profile", str(profile), "--submitit-qos=a", "--submitit-qos", "b"]
    assert slurm_defaults(argv, {}) == {"partition": ("big", str(profile / "config.yaml")),
                                        "qos": ("b", "--submitit-qos")}
    from_environment = slurm_defaults(["snakemake"], {"SNAKEMAKE_PROFILE": str(profile)})
    assert from_environment["qos"] == ("low", str(profile / "config.yaml"))
