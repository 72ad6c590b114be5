"""Fetch on the submitting node, run offline on compute nodes (docs/guides/slurm.md, "Offline compute
nodes"): Snakemake fetches a study's hub models and data sets before any job, every job runs with the
hub out of reach and without the token, what an offline node lacks is one error before any job, and
nodes > 1 for training where the jobs run on this machine is a config error. Real Snakemake
(profiles/local) against the test hub."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import test_workflow
import yaml

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = [*test_workflow.SNAKEMAKE, "--profile", str(REPO / "profiles" / "local"), "--cores", "1"]
TOY = {**yaml.safe_load((REPO / "benchmarks" / "slurm_study.yaml").read_text()), "results": "results"}
# Each Python process of a job writes its hub settings (and any token) here: what the job's environment was.
SPY = textwrap.dedent("""
    import json, os
    _out = os.environ.get("KLSTUDY_TEST_ENV_DIR")
    if _out:
        _argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
        _keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
        with open(os.path.join(_out, str(os.getpid())), "w") as _f:
            json.dump({"argv": [a.decode() for a in _argv if a], "env": {k: os.environ.get(k) for k in _keys}}, _f)
""")


def study(directory: Path, **changes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "study.yaml"
    path.write_text(yaml.safe_dump({**TOY, **changes}))
    return path


def snakemake(directory: Path, config: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """Snakemake's output, its log and errors together, in `stdout`."""
    return subprocess.run([*SNAKEMAKE, *args, "--directory", str(directory), "--configfile", str(config)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=900)


def with_repo(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
            "OMP_NUM_THREADS": "1"}


# The hub model and data sets of a small study on the gated stand-in: training on MATH-lighteval,
# evaluation on MATH-500 (lm-eval's default data set of math500).
GATED_STUDY = {"models": {"llama": {"path": "meta-llama/Llama-3.1-8B-Instruct"}},
               "grid": {"estimators": ["k1"], "placements": ["reward"], "betas": [0.1], "seeds": [0],
                        "baseline": False},
               "run": {"task": {"name": "math",
                                "options": {"path": "DigitalLearningGmbH/MATH-lighteval", "limit": 4}},
                       "rollout": {"max_new_tokens": 4},
                       "train": {"steps": 1, "prompts_per_step": 2, "group_size": 2}, "checkpoint": {"every": 1}},
               "data": {},
               "evaluate": {"suites": ["math500"], "samples": 1, "limit": 2, "max_gen_toks": 4, "data": {}},
               "resources": {"default": {"cpus": 1, "mem_mb": 4000, "runtime": 20}}}


def test_nodes_above_one_for_training_where_jobs_run_on_this_machine_is_a_config_error(tmp_path):
    """Training on several nodes starts its processes with srun in a SLURM job (trainer.srun): a dry run plans
    it, and a run whose jobs would run on this machine (the local profile) stops with one error before any job."""
    env = with_repo(dict(os.environ))
    for rule, nodes in (("train", 2), ("default", 3)):
        config = study(tmp_path / rule, resources={rule: {"nodes": nodes}})
        planned = snakemake(tmp_path / rule, config, env, "-n")
        assert planned.returncode == 0 and f"--nodes={nodes}" in planned.stdout, planned.stdout[-2000:]
        done = snakemake(tmp_path / rule, config, env)
        assert done.returncode != 0
        assert (f"study config: resources.{rule}.nodes: {nodes}, but the jobs run on this machine (Snakemake's local "
                "executor), and training on several nodes starts its processes with srun in a SLURM job: run with "
                f"--profile profiles/slurm, or set resources.{rule}.nodes: 1") in done.stdout, done.stdout[-2000:]
        assert not (tmp_path / rule / "results" / "models").exists()  # no job ran
    models = {"toy-sft": {**TOY["models"]["toy-sft"], "resources": {"train": {"nodes": 2}}}}
    done = snakemake(tmp_path / "model", study(tmp_path / "model", models=models), env)
    assert "study config: models.toy-sft.resources.train.nodes: 2, but the jobs run on this machine" in done.stdout


def test_offline_node_names_what_is_not_fetched_then_the_fetch_command_fixes_it(hub, tmp_path):
    """Snakemake on an offline node: a data set missing from the cache is one error before any job, naming it
    and the fetch command; `python -m sweep fetch` on a node with the network fills the cache."""
    config = study(tmp_path / "study", evaluate={"suites": ["toy", "mmlu_college_biology"], "samples": 1,
                                                 "data": {"arith": "heldout"}})
    offline = with_repo(hub.env(tmp_path / "hf", offline=True))
    done = snakemake(tmp_path / "study", config, offline, "-n")
    assert done.returncode != 0
    assert (f"study config: evaluate.suites (mmlu_college_biology): dataset cais/mmlu:college_biology is not in the "
            f"Hugging Face cache, and HF_HUB_OFFLINE is set here, so this run cannot fetch it for its offline jobs "
            f"(fetch on a node with the network: python -m sweep fetch --configfile {config})") in done.stdout, \
        done.stdout[-3000:]
    fetched = subprocess.run([sys.executable, "-m", "sweep", "fetch", "--configfile", str(config)], capture_output=True,
                             text=True, env=with_repo(hub.env(tmp_path / "hf")), cwd=tmp_path / "study")
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    assert "klstudy fetch: dataset cais/mmlu:college_biology" in fetched.stderr
    done = snakemake(tmp_path / "study", config, offline, "-n")
    assert done.returncode == 0, done.stdout[-3000:]


def test_a_gated_model_without_a_token_stops_the_study_before_any_job(hub, tmp_path):
    config = study(tmp_path, **GATED_STUDY)
    done = snakemake(tmp_path, config, with_repo(hub.env(tmp_path / "hf")))
    assert done.returncode != 0
    assert ("fetch: models.llama.path: meta-llama/Llama-3.1-8B-Instruct is a gated model and this node has no token "
            "(export HF_TOKEN=hf_... or run `hf auth login` here, then run again") in done.stdout, done.stdout[-3000:]
    results = tmp_path / "results"  # the main process may have written the runs' configs; no job ran
    assert not (results / "runs").exists() and not (results / "logs").exists() and not (results / "models").exists()


def test_jobs_run_offline_and_never_see_the_token(hub, tmp_path):
    """A study whose model is gated and whose training and evaluation data come from the hub: everything is
    fetched by Snakemake's own process with HF_TOKEN; every job's processes run with the hub out of reach
    and no token, and the token is in no file the study wrote (the runs' config.yaml, the logs, MLflow's
    store with every run's params) nor in Snakemake's output."""
    spy, envs = tmp_path / "spy", tmp_path / "envs"
    spy.mkdir()
    envs.mkdir()
    (spy / "sitecustomize.py").write_text(SPY)
    config = study(tmp_path / "study", **GATED_STUDY)
    env = with_repo({**hub.env(tmp_path / "hf"), "HF_TOKEN": hub.token, "KLSTUDY_TEST_ENV_DIR": str(envs)})
    env["PYTHONPATH"] += os.pathsep + str(spy)
    done = snakemake(tmp_path / "study", config, env)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "klstudy fetch: model meta-llama/Llama-3.1-8B-Instruct" in done.stdout
    seen = [yaml.safe_load(path.read_text()) for path in envs.iterdir()]
    jobs = [s for s in seen if any(module in s["argv"] for module in ("trainer", "eval"))]
    assert {tuple(s["argv"][1:4]) for s in jobs} >= {("-m", "trainer", "fetch-model"), ("-m", "trainer", "train"),
                                                      ("-m", "eval", "run")}
    for job in jobs:
        assert job["env"] == {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
                              "HF_TOKEN": None, "HUGGING_FACE_HUB_TOKEN": None}, job
    written = [path for path in (tmp_path / "study").rglob("*") if path.is_file()]
    # the runs' configs and the MLflow store (params, tags, the run's files) are among the files searched
    assert {"config.yaml", "mlflow.db"} <= {path.name for path in written}
    leaked = [str(path) for path in written if hub.token.encode() in path.read_bytes()]
    assert not leaked and hub.token not in done.stdout


def test_a_job_that_reaches_for_the_hub_fails_at_once(hub, tmp_path):
    """What sweep.hub.job_env gives a job: the hub at a closed port and offline, so a download that was not
    fetched fails loudly (here a data set of the test hub, in a job's environment)."""
    from sweep.hub.job_env import make_offline

    env = with_repo(hub.env(tmp_path / "hf"))
    make_offline(env)
    done = subprocess.run([sys.executable, "-c", "import datasets; datasets.load_dataset('HuggingFaceH4/MATH-500')"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "OfflineModeIsEnabled" in done.stderr, done.stderr[-2000:]


def test_the_hub_failing_mid_fetch_is_one_error_and_the_next_fetch_takes_only_what_is_left(hub, tmp_path):
    """The hub goes away as the fetch begins its second of three data sets (issue 61's fault): one error naming
    the one that failed and the one still missing; the first stays in the cache, and the next fetch, the hub
    back, takes the two left and asks the hub nothing of the first."""
    from hub_server import start

    subsets = ["college_biology", "college_chemistry", "college_physics"]
    config = study(tmp_path / "study", evaluate={"suites": [f"mmlu_{s}" for s in subsets], "samples": 1,
                                                 "data": {}})
    command = [sys.executable, "-m", "sweep", "fetch", "--configfile", str(config)]
    first = start(tmp_path / "hub-first", hub.mirror)
    try:
        fetching = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=with_repo(first.hub.env(tmp_path / "hf")), cwd=tmp_path / "study")
        said = []
        for line in fetching.stderr:
            said.append(line)
            if line.startswith("klstudy fetch: ") and len([s for s in said if s.startswith("klstudy fetch: ")]) == 2:
                os.kill(fetching.pid, signal.SIGSTOP)  # held as it begins the second, while the hub goes away
                first.stop()
                os.kill(fetching.pid, signal.SIGCONT)
        assert fetching.wait(timeout=300) != 0
    finally:
        first.stop()
    error = "".join(said)
    assert ("could not fetch dataset cais/mmlu:college_chemistry" in error and "still missing after it: dataset "
            "cais/mmlu:college_physics (1 of 3 fetched and kept: fetch again once the hub answers" in error), error
    again = start(tmp_path / "hub-again", hub.mirror)
    try:
        fetched = subprocess.run(command, capture_output=True, text=True, env=with_repo(again.hub.env(tmp_path / "hf")),
                                 cwd=tmp_path / "study", timeout=300)
    finally:
        again.stop()
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    assert [line.split(" (")[0] for line in fetched.stderr.splitlines() if line.startswith("klstudy fetch: ")] == \
        ["klstudy fetch: dataset cais/mmlu:college_chemistry", "klstudy fetch: dataset cais/mmlu:college_physics"]
    assert "3 hub model(s) and data set(s) cached, 2 fetched now" in fetched.stdout
    asked = (tmp_path / "hub-again" / "nginx-access.log").read_text()
    assert "/resolve/" in asked and "college_chemistry/test-" in asked  # what was left was downloaded
    assert "college_biology/" not in asked  # nothing of the first twice (the data set's tree lists it, that is all)
