"""Shared fixtures: a toy model and a warmed-up toy model, built once per test session; the reduced toy
studies' prepare stage, run once; a pair of float64 models a little apart; a model whose tokens are confident,
with completions it sampled; SmolLM2-135M-Instruct, a real model, imported once into the cache; a real hub
server serving it and the paper's data sets on 127.0.0.1."""

import copy
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from trainer.batch import Rollouts, pack
from trainer.model.models import ToyModelSpec, build_toy_model, load_model

# vLLM's CPU build traces each engine's model once and runs it eagerly instead of compiling it with
# inductor, the switch its own CPU CI uses: a SmolLM2 engine started in 3 to 4 minutes of compiling
# (its compile cache does not load on this build), and the tests start several. Children inherit it.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

# OpenMP's threads sleep while they wait rather than spin: a job the suite starts as a user would (a guide's
# recipe as written) takes its rule's threads, 2 on these configs, and two such jobs on a machine of 2 cores,
# or one beside the suite's other process, spin on the cores they share. Two processes of 2 threads each on 2
# cores, a model of SmolLM2's sizes: 16 tokens decoded in 2.4 s with it against 62.9 s without, a training pass
# 3.6 s against 29.5 s (benchmarks/shared_cores.py). Children inherit it, SLURM's jobs too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# Job processes start warm: every `python -m trainer|eval` (and `sweep track|report`) that a test starts, itself
# or through Snakemake, is forked from a process that has imported torch, transformers and lm-eval (MLflow,
# SciPy, matplotlib); tests/warm_start/klstudy_warm_start.py says how, and which processes keep their own start.
# KLSTUDY_WARM_START=0 turns it off.
WARM_START = Path(__file__).resolve().parent / "warm_start"
WARM_DIR = "KLSTUDY_WARM_DIR"
SNAKEMAKE_THREADS = ("GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                     "NUMEXPR_NUM_THREADS")


def pytest_configure(config):
    """Turns the warm start on for the processes this session starts (pytest-xdist's workers inherit it)."""
    if os.environ.get("KLSTUDY_WARM_START") == "0" or os.environ.get(WARM_DIR):
        return
    config.warm_start_dir = tempfile.mkdtemp(prefix="klstudy-warm-")  # short: a socket's path has 107 bytes
    if not start_warm_broker(config.warm_start_dir):
        print(f"warm start: off, its broker did not start (see {config.warm_start_dir})")
        return
    os.environ[WARM_DIR] = config.warm_start_dir
    os.environ["PYTHONPATH"] = os.pathsep.join([str(WARM_START), *filter(None, [os.environ.get("PYTHONPATH")])])
    # What Snakemake's shell adds to a job's environment (the rule's threads for every maths library, and its
    # tmpdir), with the values it adds here: a test's own `python -m trainer` and a study's job then share a
    # zygote, where they had one each (a zygote is a few seconds of imports).
    threads = os.environ.get("OMP_NUM_THREADS")
    for name in SNAKEMAKE_THREADS if threads else ():
        os.environ.setdefault(name, threads)
    for name in ("TMPDIR", "TMP", "TEMPDIR", "TEMP"):
        os.environ.setdefault(name, tempfile.gettempdir())


def cold_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` for processes that start as a user's jobs start, each a fresh interpreter that imports everything
    itself: no warm start (its sitecustomize off PYTHONPATH, its variables gone). Also for jobs on another host
    (a namespace of profiles/slurm/local-cluster.sh up --hosts), which a zygote on this host must not run."""
    path = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(WARM_START))
    cold = {key: value for key, value in env.items() if not key.startswith("KLSTUDY_WARM")}
    return {**cold, "KLSTUDY_WARM_START": "0", "PYTHONPATH": path}


def start_warm_broker(directory: str) -> bool:
    """Starts the process that starts the zygotes of `directory`, outside of every job; whether it listens."""
    with open(os.path.join(directory, "broker.log"), "ab") as log:
        return subprocess.run([sys.executable, str(WARM_START / "klstudy_warm_start.py"), "--broker", directory],
                              stdout=subprocess.DEVNULL, stderr=log).returncode == 0


def pytest_unconfigure(config):
    """Stops the session's broker and zygotes (a zygote left alone would exit after an idle minute)."""
    directory = getattr(config, "warm_start_dir", None)
    if directory is None:
        return
    for pid_file in Path(directory).glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ValueError, ProcessLookupError):
            pass
    shutil.rmtree(directory, ignore_errors=True)


# The files whose tests run on the local SLURM cluster (the `slurm` fixture; test_cluster_hosts.py restarts it as
# a cluster of hosts, and back). `make test` spreads the suite over two processes (pytest-xdist); these files share
# one of them and run one test at a time, for the node has two CPUs, and a study whose jobs queued behind another
# test's would run into its timeouts.
CLUSTER_FILES = {"test_cluster_hosts.py", "test_slurm.py", "test_study_heals.py"}


# The files whose tests share a fixture that is slow to build (an MLflow server over a synced study, the rollout
# engines, vLLM's among them, the hub server, the tracking tests' MLflow server): their tests go to one process,
# which builds it once, not both.
TOGETHER_FILES = {"test_mlflow_ui.py", "test_rollout_contract.py", "test_smollm2_rollout.py", "test_hub_server.py",
                  "test_tracking.py"}


# The files whose tests take the longest, longest first (the cluster's files first: test_cluster_hosts.py alone,
# the rehearsal across hosts and the node that dies among its tests, takes about 13 minutes on 2 cores; then the
# SmolLM2 study, ... the distributed runs). Their tests are collected first, in this order, and handed out first:
# the two processes then end together, on short tests, where one of them used to run the last studies alone for
# 100 s. A file missing here only goes out later. test_cluster_hosts.py is first of the cluster's files, which go
# out together whatever their order: it restarts the cluster as three hosts and gives the one-node cluster back,
# and the others then check that it did.
LONGEST_FIRST = ("test_cluster_hosts.py", "test_slurm.py", "test_study_heals.py", "test_smollm2_study.py",
                 "test_smollm2_rollout.py", "test_smollm2_pipeline.py", "test_hub_server.py",
                 "test_mlflow_ui.py", "test_vllm_training.py", "test_workflow.py", "test_doc_commands.py",
                 "test_tracking.py", "test_rollout_contract.py", "test_distributed.py")


def pytest_collection_modifyitems(items):
    """The tests of LONGEST_FIRST's files first, in its order; the others after, as collected. Each file's
    tests stay together and in their order (module fixtures are built once)."""
    def rank(item) -> int:
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


def on_cluster(path: str) -> bool:
    """Whether the test file at `path` (a node id's file part or a file name) is one of CLUSTER_FILES."""
    return path.rsplit("/", 1)[-1] in CLUSTER_FILES


def scheduling_scope(nodeid: str) -> str:
    """The unit the suite's processes are handed: the cluster, a file of TOGETHER_FILES, or else one test."""
    path = nodeid.split("::")[0]
    if on_cluster(path):
        return "cluster"
    return path if path.rsplit("/", 1)[-1] in TOGETHER_FILES else nodeid


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by scope (`scheduling_scope`): the tests of CLUSTER_FILES share one, those of
    each file of TOGETHER_FILES one, and every other test is its own. (`--dist loadgroup` cannot group here:
    it renames the tests' ids, which pytest 9 no longer reads.) Scopes go out in the order of collection
    (LONGEST_FIRST), not by their number of tests (xdist's --loadscope-reorder): the cluster's, the longest,
    starts at once. Only `--dist load`, what `-n` does by default, is replaced: another `--dist` keeps its own
    scheduler, without the grouping."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ClusterTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_scope(nodeid)

    config.option.loadscopereorder = False
    return ClusterTogether(config, log)


def built_once(request, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `name`, which `build(path)` writes once for the whole session rather than once in each
    pytest-xdist process: the processes share the parent of their base temporary directories, the first
    that needs it builds it under a lock, and the others wait for it and read it. Tests only read it."""
    root = request.getfixturevalue("tmp_path_factory").getbasetemp()
    if hasattr(request.config, "workerinput"):  # a pytest-xdist worker
        root = root.parent
    path, built = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.exists():
            shutil.rmtree(path, ignore_errors=True)  # what a build that failed left
            build(path)
            built.touch()
    return path


@pytest.fixture(scope="session")
def toy_model(request):
    """A randomly initialised character-level toy Llama (a directory)."""
    return built_once(request, "toy", lambda path: build_toy_model(path, ToyModelSpec()))


@pytest.fixture(scope="session")
def untied_toy_model(request):
    """The toy model with an output layer of its own (not the input embedding)."""
    return built_once(request, "toy-untied", lambda path: build_toy_model(path, ToyModelSpec(tie_embeddings=False)))


@pytest.fixture(scope="session")
def warm_model(toy_model, request):
    """The toy model after a short supervised warm-up on single-digit arithmetic."""
    from trainer.sft import sft

    def warm_up(out: Path) -> None:
        report = sft(str(toy_model), "arithmetic", out, {"max_operand": 9}, steps=150, batch_size=64,
                     eval_problems=64)
        assert report["sampled_reward"] > 0.2, report  # RL starts with a reward clearly above zero

    return built_once(request, "toy-sft", warm_up)


@pytest.fixture(scope="session")
def prepared_toy_study(request):
    """The prepare stage (build_model, prepare_data, audit) of the reduced toy studies of test_workflow.py
    and test_study_heals.py, which share their models and data, run once through Snakemake: each study
    starts from a copy of it (test_workflow.from_prepared checks that the models and data are the same)."""
    from test_workflow import REDUCED, prepare

    def run_prepare(path: Path) -> None:
        path.mkdir()
        prepare(path, REDUCED)

    return built_once(request, "prepared", run_prepare)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct's imported model directory (shared by every test: do not write into it)."""
    from smollm2_required import require_smollm2

    return require_smollm2()


@pytest.fixture(scope="session")
def hub(request, tmp_path_factory):
    """A real Hugging Face hub on 127.0.0.1 for the session (tests/hub_server.py): olah in its offline mode
    behind nginx, serving SmolLM2-135M-Instruct as `hub.model_id` and as each of the paper's models
    (`hub.stand_ins`, `hub.gated_id` only with `hub.token`), and the paper's data sets in their real
    layouts. Clients get it through `hub.env(hf_home)` (HF_ENDPOINT=`hub.endpoint`)."""
    from hub_mirror import mirror_tree
    from hub_server import require_hub, start

    require_hub()
    running = start(tmp_path_factory.mktemp("hub"), mirror_tree(request.getfixturevalue("smollm2")))
    yield running.hub
    running.stop()


@pytest.fixture
def model_and_perturbed_copy(toy_model):
    """The toy model in float64 and a copy of it whose every weight moved by 0.05 x N(0, 1) (seed 0):
    two models whose next-token distributions differ everywhere, for exact KL checks."""
    torch.manual_seed(0)
    model = load_model(str(toy_model)).double()
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model, moved


@pytest.fixture(scope="session")
def confident_model():
    """A one-layer Llama (vocabulary 8,000, hidden size 32) that repeats its input token with probability
    about 0.99 (top logits near 17; its output layer is its embedding, scaled), and a packed batch of
    8 completions of 64 tokens it sampled: 512 positions where bf16 rounding of the logits is largest
    against 1 - p. Shared by the session: copy it before changing it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(generator=gen)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * (15 / 32))
        ids = torch.randint(8000, (8, 1), generator=gen)
        for _ in range(64):
            probs = torch.softmax(model(ids).logits[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    rollouts = Rollouts([[int(i)] for i in ids[:, 0]], ids[:, 1:].tolist(), [[0.0] * 64] * 8, [""] * 8,
                        ["length"] * 8, 1)
    return model, pack(rollouts, pad_id=0)


def cluster_up() -> bool:
    """Whether a SLURM cluster answers here with a node that can run jobs."""
    if shutil.which("sinfo") is None:
        return False
    state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return state.returncode == 0 and any(s.strip() in ("idle", "mix", "alloc") for s in state.stdout.split())


@pytest.fixture(scope="module")
def slurm(request):
    """A SLURM cluster (profiles/slurm/local-cluster.sh up): skipped without one, failed with
    KLSTUDY_REQUIRE_SLURM=1 (CI). A test outside CLUSTER_FILES fails before it touches the cluster: it would
    share it with another process's tests."""
    if not on_cluster(request.path.name):
        pytest.fail(f"{request.path.name} uses the SLURM cluster: add it to CLUSTER_FILES in tests/conftest.py",
                    pytrace=False)
    if not cluster_up():
        if os.environ.get("KLSTUDY_REQUIRE_SLURM") == "1":
            pytest.fail("no SLURM cluster: run profiles/slurm/local-cluster.sh up")
        pytest.skip("no SLURM cluster (profiles/slurm/local-cluster.sh up starts one)")
