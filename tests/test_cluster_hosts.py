"""A cluster of hosts on this machine (profiles/slurm/local-cluster.sh up --hosts 3): three compute hosts, each
a network namespace with its own hostname, address and slurmd, that reach the login host by its name and
nothing beyond their bridge; an outside host that only the login host reaches; and `up` and `down` that
take it all away again. On it, as on a cluster whose jobs start cold on other machines:
- the paper study's rehearsal as docs/guides/slurm.md's recipe says: the hub on the outside host, MLflow by
  the login host's name, one model's training over two hosts, the runs page in Chromium by name;
- a training job over two hosts against one process, step by step;
- a cluster's faults: a compute host that dies mid-training, and SLURM's SIGTERM to every process of a job
  while its verifier's workers start or score.

The module's fixture brings up three hosts and, at the end, gives back the cluster it found: the one-host
cluster up if it was up (CI runs the suite with it), or nothing. Needs root, `ip`, `unshare`, `nsenter`
and SLURM; without them these tests skip, unless KLSTUDY_REQUIRE_SLURM=1: then they fail.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import cluster_up, cold_environment, on_cluster
from doc_recipes import linked_copy, recipe_block
from hub_mirror import MODEL_ID
from hub_server import stop_process, wait_until_answers
from run_helpers import assert_trains_as_one_process
from test_paper_rehearsal import MODELS, paper_cpu
from test_workflow import SNAKEMAKE

from eval.suites import IN_DOMAIN, OUT_OF_DOMAIN
from trainer.run_files import COMPLETE, read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "profiles" / "slurm" / "local-cluster.sh"
HOSTS = {"cn1": "10.87.0.11", "cn2": "10.87.0.12", "cn3": "10.87.0.13"}
LOGIN_NAME, LOGIN_ADDR = "klstudy-login", "10.87.0.1"
OUTSIDE_NAME, OUTSIDE_ADDR, OUTSIDE_NAMESPACE = "klstudy-hub", "10.87.1.2", "klstudy-outside"
NAMESPACES = {"klstudy-cn1", "klstudy-cn2", "klstudy-cn3", OUTSIDE_NAMESPACE}
HOSTS_MARKER = "# klstudy local cluster: begin"

# What a compute host sees, as JSON: its hostname, its routes, a connection to the outside host's address (where
# a server listens) and to an address beyond every network here (TEST-NET-1), whether the outside host's name
# resolves, and the login host's HTTP server asked by the login host's name. Run with `python -I`: no
# PYTHONPATH (the suite's warm start), and no proxy from the environment.
PROBE = r"""
import json, os, socket, subprocess, sys, urllib.request
login_url, outside = sys.argv[1], (sys.argv[2], int(sys.argv[3]))

def connect(address):
    try:
        socket.create_connection(address, timeout=10).close()
        return "connected"
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)

def resolves(name):
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None

opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
print(json.dumps({
    "hostname": socket.gethostname(),
    "routes": subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout,
    "outside": connect(outside),
    "elsewhere": connect(("192.0.2.1", 80)),
    "outside_name": resolves("klstudy-hub"),
    "login": opener.open(login_url, timeout=10).read().decode(),
}))
"""


def cannot_run() -> str | None:
    """Why this machine cannot run a cluster of hosts, or None."""
    if os.geteuid() != 0:
        return "not root: the hosts are network namespaces, and the cluster's daemons run as root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (Debian: iproute2, util-linux)"
    if shutil.which("slurmctld") is None:
        return "SLURM is not installed (profiles/slurm/local-cluster.sh up installs it)"
    return None


def cluster(*args: str) -> subprocess.CompletedProcess:
    """profiles/slurm/local-cluster.sh ARGS, which must succeed. Its own CPU count, not the suite's
    OMP_NUM_THREADS=1 (GNU nproc answers that)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
    done = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"local-cluster.sh {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def run(*command: str, timeout: float = 120) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def hosts(request):
    """`up --hosts 3`; afterwards the one-host cluster again if it was up, or nothing."""
    if not on_cluster(request.path.name):
        pytest.fail(f"{request.path.name} uses the SLURM cluster: add it to CLUSTER_FILES in tests/conftest.py",
                    pytrace=False)
    reason = cannot_run()
    if reason:
        if os.environ.get("KLSTUDY_REQUIRE_SLURM") == "1":
            pytest.fail(f"KLSTUDY_REQUIRE_SLURM=1, but no cluster of hosts can run here: {reason}", pytrace=False)
        pytest.skip(f"no cluster of hosts: {reason}")
    was_up = cluster_up()
    try:
        cluster("up", "--hosts", str(len(HOSTS)))
        yield
    finally:
        if was_up:
            cluster("up")
        else:
            cluster("down")


class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"login host, asked for {self.headers['Host']}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def login_server():
    """An HTTP server of the login host on the bridge's address (as MLflow would listen for the jobs): its port."""
    server = http.server.ThreadingHTTPServer((LOGIN_ADDR, 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def no_proxy() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture
def outside_server():
    """An HTTP server on the outside host (where the hub would be): its port."""
    port = 8000  # the outside host's own network: nothing else listens there
    process = subprocess.Popen(["ip", "netns", "exec", OUTSIDE_NAMESPACE, sys.executable, "-I", "-m", "http.server",
                                "--bind", OUTSIDE_ADDR, str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        for _ in range(100):
            assert process.poll() is None, process.stderr.read()
            try:
                socket.create_connection((OUTSIDE_ADDR, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_sinfo_shows_the_three_compute_hosts_idle_each_at_its_own_address(hosts):
    nodes = [line.split() for line in run("sinfo", "-h", "-N", "-o", "%N %o %t %c %m").splitlines()]
    assert {node: address for node, address, *_ in nodes} == HOSTS
    assert all(state == "idle" for _, _, state, _, _ in nodes), nodes


def test_a_job_on_three_nodes_runs_once_on_each_host_under_its_hostname(hosts, tmp_path):
    printed = run("srun", "--nodes=3", "hostname", timeout=60)
    print(f"\nsrun --nodes=3 hostname:\n{printed}")
    assert sorted(printed.split()) == sorted(HOSTS)

    # The same from a batch job, whose step starts from the first host: compute hosts reach one another.
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nhostname\nsrun --nodes=3 hostname | sort\n")
    run("sbatch", "--wait", "--nodes=3", f"--output={out}", str(script), timeout=120)
    assert out.read_text().split() == ["cn1", "cn1", "cn2", "cn3"]


def probe(*prefix: str, login_port: int, outside_port: int) -> dict:
    return json.loads(run(*prefix, sys.executable, "-I", "-c", PROBE, f"http://{LOGIN_NAME}:{login_port}/",
                          OUTSIDE_ADDR, str(outside_port), timeout=120))


@pytest.mark.parametrize("where", ["namespace", "job"])
def test_a_compute_host_reaches_the_login_host_by_name_and_nothing_beyond_the_bridge(hosts, where, login_server,
                                                                                     outside_server):
    prefix = (["ip", "netns", "exec", "klstudy-cn1"] if where == "namespace" else
              ["srun", "--nodes=1", "--nodelist=cn1"])
    seen = probe(*prefix, login_port=login_server, outside_port=outside_server)
    if where == "job":
        assert seen["hostname"] == "cn1"
    assert [line.split()[0] for line in seen["routes"].splitlines()] == ["10.87.0.0/24"], seen["routes"]  # no default
    assert seen["outside"] == seen["elsewhere"] == "Network is unreachable", seen
    assert seen["outside_name"] is None  # its name is the login host's alone
    assert seen["login"] == f"login host, asked for {LOGIN_NAME}:{login_server}"


def test_the_login_host_reaches_the_outside_host_by_name(hosts, outside_server):
    with no_proxy().open(f"http://{OUTSIDE_NAME}:{outside_server}/", timeout=10) as answer:
        assert answer.status == 200


# --- the paper rehearsal across the hosts --------------------------------------------------------------------

GUIDE = REPO / "docs" / "guides" / "slurm.md"
RECIPE_MARKER = "<!-- recipe: the paper study on a SLURM cluster -->"
HOSTS_RECIPE_MARKER = "<!-- recipe: a cluster of hosts -->"
TWO_NODE_MODEL = "Qwen2.5-7B"  # paper_cpu_hosts.yaml: its training spans two nodes
MATH2_STAND_IN = '{"problem": "What is $1 + 1$?", "answer": "2"}'
# What the working directory of the recipe does not take from the repository: what the recipe writes.
NOT_LINKED = {".git", "results", ".snakemake", "site", "data", ".hf-cache", "my-cluster.yaml", "mlflow.db",
              "mlartifacts"}


def recipe(marker: str) -> list[str]:
    """The lines of the docs/guides/slurm.md block after `marker`."""
    return recipe_block(GUIDE, marker)


def on_the_hosts(lines: list[str], port: int) -> list[str]:
    """The guide's recipe as the cluster of hosts runs it: what differs from a real cluster, and nothing else.
    `make setup` is the suite's; MATH^2 a stand-in record where there is no file; the study at CPU size
    with one model over two nodes; the local cluster's partition; a free port for MLflow's 5000."""
    cpu_size = "workflow/config/paper.yaml workflow/config/paper_cpu.yaml workflow/config/paper_cpu_hosts.yaml "
    changed, ran = 0, []
    for line in lines:
        if line == "make setup":
            changed += 1
            continue
        new = (line.replace("workflow/config/paper.yaml ", cpu_size)
               .replace("SNAKEMAKE_SUBMITIT_PARTITION=gpu", "SNAKEMAKE_SUBMITIT_PARTITION=debug")
               .replace(":5000", f":{port}").replace("--port 5000", f"--port {port}"))
        if re.fullmatch(r"mkdir -p data && cp \S+ data/math2\.jsonl", line):
            new = f"mkdir -p data && (test -f data/math2.jsonl || echo '{MATH2_STAND_IN}' > data/math2.jsonl)"
        changed += new != line
        ran.append(new)
    assert changed == 8, f"docs/guides/slurm.md's recipe changed: the test's changes no longer fit it:\n{lines}"
    return ran


def words(line: str) -> list[str]:
    """A recipe line's words, a trailing `&` (a server left running) dropped."""
    found = shlex.split(line)
    return found[:-1] if found[-1] == "&" else found


def started_as_written(command: list[str], cwd: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A server of the recipe, as written: its leading VAR=value words its environment, `.venv/bin/X` this
    interpreter's X, paths of the repository absolute; its output in `log`."""
    settings = {}
    while "=" in command[0]:
        name, value = command.pop(0).split("=", 1)
        settings[name] = value
    program, *args = command
    program = str(Path(sys.executable).parent / Path(program).name) if program.startswith(".venv/") else program
    args = [str(REPO / a) if (REPO / a).is_file() else a for a in args]
    with log.open("w") as out:
        return subprocess.Popen([program, *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**env, **settings})


def sacct_jobs(since: str) -> list[dict[str, str]]:
    """Every job and step SLURM accounted since `since` (sacct's time): its id, name, nodes and state."""
    fields = ["JobID", "JobName", "NNodes", "NodeList", "State"]
    out = run("sacct", "-n", "-P", "-S", since, "-o", ",".join(fields))
    return [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines()]


def clients_of(server_log: Path) -> set[str]:
    """The addresses MLflow's server answered requests from (uvicorn's access log: `... INFO: ADDR:PORT - "..."`)."""
    return set(re.findall(r"INFO:\s+(\d+\.\d+\.\d+\.\d+):\d+ - \"", server_log.read_text()))


def test_the_paper_study_at_cpu_size_runs_across_the_hosts_as_the_guide_says(hosts, smollm2, tmp_path):
    """docs/guides/slurm.md's recipe, its lines as written but for what on_the_hosts changes, run by bash from the
    login host in a directory of its own (the repository's files linked into it): paper_cpu.yaml, with one
    model's training over two nodes, through profiles/slurm. The fetch reaches the hub on the outside host by
    name; the jobs, which could not reach it, train and evaluate on the compute hosts and start as a user's start
    (no warm start: a zygote here would run them on the login host); their followers track to the MLflow server
    by the login host's name; the two-node training is one process's to rounding; Chromium opens the study's
    runs by the login host's name; `sweep status` lists every point done."""
    from browser_required import browser, require_browser
    from test_tracking import child_runs, free_port

    require_browser()  # before the slow part: skip (or fail in CI) at once
    up, wait_policy, hub_line, down = recipe(HOSTS_RECIPE_MARKER)
    assert words(up) == ["profiles/slurm/local-cluster.sh", "up", "--hosts", str(len(HOSTS))]  # what `hosts` ran
    assert words(down) == ["profiles/slurm/local-cluster.sh", "down"]  # what `hosts` runs last, unless CI's one node
    export, setting = words(wait_policy)
    assert export == "export" and setting.startswith("OMP_WAIT_POLICY="), wait_policy
    cold = {k: v for k, v in cold_environment(dict(os.environ)).items()
            if not k.startswith(("HF_", "HUGGING_FACE_", "OMP_WAIT_POLICY"))}
    cold.update([setting.split("=", 1)])  # the guide's wait policy, not the suite's
    hub_command = words(hub_line)
    assert hub_command[:2] == [".venv/bin/python", "tests/hub_server.py"] and "--outside" in hub_command
    hub_command[-1] = str(tmp_path / "hub")  # its directory, in the test's own
    servers = [started_as_written(hub_command, REPO, tmp_path / "hub.log", cold)]
    work = linked_copy(tmp_path / "login", NOT_LINKED)
    port = free_port()
    tracking = f"http://{LOGIN_NAME}:{port}"
    script = work / "recipe.sh"
    script.write_text("set -euo pipefail\n"
                      f"hostname() {{ echo {LOGIN_NAME}; }}  # the login node's name, as the compute hosts know it\n"
                      f"export HF_ENDPOINT=http://{OUTSIDE_NAME}:8000 PYTHONUNBUFFERED=1  # the test hub\n"
                      + "\n".join(on_the_hosts(recipe(RECIPE_MARKER), port)) + "\n")
    log = tmp_path / "recipe.log"
    try:
        wait_until_answers(f"http://{OUTSIDE_NAME}:8000/api/models/{MODEL_ID}/revision/main", servers[0],
                           tmp_path / "hub.log", "the hub", timeout=180)
        since = run("date", "+%Y-%m-%dT%H:%M:%S").strip()
        started = time.monotonic()
        with log.open("w") as out:
            process = subprocess.Popen(["bash", str(script)], cwd=work, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True, env=cold)
        servers.append(process)  # its process group: the MLflow server the recipe leaves running
        try:
            process.wait(timeout=2400)  # a hang detector
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGINT)  # Snakemake cancels its SLURM jobs
            process.wait(timeout=120)
            pytest.fail(f"the recipe across hosts ran past 40 minutes:\n{log.read_text()[-5000:]}")
        study_s = time.monotonic() - started
        output = log.read_text()
        assert process.returncode == 0, output[-6000:]

        # fetched on the login host, from the outside host, by name: every request the hub saw came from there
        for need in ("model HuggingFaceTB/SmolLM2-135M-Instruct", "dataset DigitalLearningGmbH/MATH-lighteval",
                     "dataset HuggingFaceH4/MATH-500", "dataset cais/mmlu:college_physics"):
            assert f"klstudy fetch: {need}" in output, output[-3000:]
        hub_clients = {line.split()[0] for line in (tmp_path / "hub" / "nginx-access.log").read_text().splitlines()}
        assert hub_clients == {"10.87.1.1"}, hub_clients  # the login host's end of the outside link
        # the dry run priced the training with the recipe's budget
        assert "(estimate: budget.step_seconds)" in output and "unknown for" not in output, output[-3000:]

        # every job ran on the compute hosts; the two-node model's training steps spanned two of them
        jobs = sacct_jobs(since)
        print(f"\nSLURM's jobs and steps: {[(j['JobName'], j['NodeList'], j['State']) for j in jobs]}")
        assert jobs and all(j["State"] == "COMPLETED" for j in jobs if "." not in j["JobID"]), jobs
        assert all(re.fullmatch(r"cn(\d|\[[\d,-]+\])", j["NodeList"]) for j in jobs), jobs
        two_node_steps = [j for j in jobs if "." in j["JobID"] and j["NNodes"] == "2"]
        assert len(two_node_steps) == 1, jobs  # one srun step of both nodes, for the two runs of its bundle

        results = work / "results" / "paper-cpu"
        for point in paper_cpu().runs:
            directory = results / "runs" / point.run_id
            assert (directory / COMPLETE).is_file(), point.run_id
            assert [m["step"] for m in read_metrics(directory / "metrics.jsonl")] == [0]
            assert read_metrics(directory / "objective.jsonl"), point.run_id  # measured on MATH's test split
            for suite, tasks in (("in_domain", IN_DOMAIN), ("out_of_domain", OUT_OF_DOMAIN)):
                scored = json.loads((results / "eval" / point.run_id / suite / "metrics.json").read_text())["tasks"]
                assert set(scored) == set(tasks), (point.run_id, suite)
                assert all(task["n"] >= 1 and 0 <= task["value"] <= 1 for task in scored.values())
        table = (results / "tables" / "results.md").read_text()
        assert all(model in table for model in MODELS) and "math500" in table and "mmlu_college_biology" in table
        assert re.search(rf"\b{len(paper_cpu().runs)} done\b", output), output[-3000:]  # sweep status, last

        # the two-node training, against one process on the same batches (the same config file, by hand)
        two_node = f"{TWO_NODE_MODEL}__k1-reward__b0.1__s0"
        train_logs = "".join(p.read_text() for p in (results / "logs" / "train").glob("*.log"))
        assert "process 0 of 2" in train_logs and "process 1 of 2" in train_logs, train_logs[-3000:]
        config_file = results / "configs" / f"{two_node}.yaml"
        alone = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(config_file), "--out",
                                str(tmp_path / "one")], capture_output=True, text=True, timeout=900,
                               env={**cold, "HF_HOME": str(work / ".hf-cache"), "HF_HUB_OFFLINE": "1",
                                    "HF_DATASETS_OFFLINE": "1"}, cwd=work)
        assert alone.returncode == 0, alone.stderr[-3000:]
        loss_gap, floor = assert_trains_as_one_process(tmp_path / "one", results / "runs" / two_node, config_file,
                                                       smollm2)  # the hub's SmolLM2, imported here

        # tracked live from the compute hosts, to the server by the login host's name: one child per run
        children, parents = child_runs(tracking, "paper")
        assert len(parents) == 1 and sorted(c.data.tags["klstudy.run_id"] for c in children) == sorted(
            point.run_id for point in paper_cpu().runs)
        assert all("loss" in c.data.metrics for c in children)
        compute_clients = clients_of(log) & set(HOSTS.values())
        assert compute_clients, clients_of(log)  # the jobs' followers, from their hosts

        # the server's page by the login host's name, then the study's runs at the link the study printed
        link = re.search(r"MLflow, the study's runs \(live\): (\S+)", output)
        assert link and link.group(1).startswith(f"{tracking}/#/experiments/"), output[-3000:]
        with browser() as context:
            page = context.new_page()
            page.goto(tracking)
            page.get_by_text("klstudy/paper").first.wait_for()  # the study's experiment, listed
            page = context.new_page()  # the link in a tab of its own (in the same page, only its #... changes)
            page.goto(link.group(1))
            shown = page.get_by_text(re.compile(r"^[1-9]\d* matching runs$"))
            shown.wait_for()
            assert shown.inner_text() == f"{len(children)} matching runs"
    finally:
        for process in reversed(servers):
            stop_process(process, timeout=30)
        with contextlib.suppress(ProcessLookupError):  # the recipe's MLflow server outlives its bash
            os.killpg(servers[-1].pid, signal.SIGKILL)
    print(f"the paper study at CPU size across 3 hosts, by the guide's recipe: {study_s:.0f} s; the two-node "
          f"training's loss differs from one process's by {loss_gap:.3g} (rounding floor {floor:.3g}); MLflow's "
          f"clients on the compute hosts: {sorted(compute_clients)}")


def test_a_training_job_over_two_hosts_makes_one_processs_updates(hosts, tmp_path):
    """resources.train {nodes: 2}: one srun step over two compute hosts, its rendezvous at the first one's name,
    gloo over TCP between them (the rehearsal's SmolLM2 run has losses of 0 at its one step: this one has
    two steps of real updates). Its losses are one process's on the same batches, to rounding."""
    from test_slurm import SLURM, SMALL, SMALL_RUNS, write_config

    config = json.loads(json.dumps(SMALL))
    config["grid"]["baseline"] = False
    config["run"]["train"].update(steps=2, lr=1e-3)
    config["resources"]["train"] = {"nodes": 2, "cpus": 1}
    name = SMALL_RUNS[0]
    env = cold_environment(dict(os.environ))  # jobs on other hosts: no zygote of this one
    since = run("date", "+%Y-%m-%dT%H:%M:%S").strip()
    done = subprocess.run([*SNAKEMAKE, *SLURM, f"results/.jobs/train/{name}.done", "--directory", str(tmp_path),
                           "--configfile", str(write_config(tmp_path, config))],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    log = (tmp_path / "results" / "logs" / "train" / f"{name}.log").read_text()
    assert log.count("process 0 of 2") == 1 and log.count("process 1 of 2") == 1, log[-3000:]
    [step] = [j for j in sacct_jobs(since) if "." in j["JobID"] and j["NNodes"] == "2"]  # the trainers' srun
    config_file = tmp_path / "results" / "configs" / f"{name}.yaml"
    one = tmp_path / "one"
    alone = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(config_file), "--out", str(one)],
                           capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    model = tmp_path / yaml.safe_load(config_file.read_text())["model"]["path"]
    loss_gap, floor = assert_trains_as_one_process(one, tmp_path / "results" / "runs" / name, config_file, model)
    losses = [m["loss"] for m in read_metrics(one / "metrics.jsonl")]
    assert any(losses), losses  # a real update was compared
    print(f"\ntwo hosts ({step['NodeList']}) vs one process: losses {losses}, differing by at most "
          f"{loss_gap:.3g} (rounding floor {floor:.3g})")


# --- a cluster's faults ------------------------------------------------------------------------------------

def squeue_jobs() -> list[dict[str, str]]:
    fields = ["JobID", "State", "Name", "NodeList"]
    out = run("squeue", "-h", "-o", "%i|%T|%j|%N")
    return [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines()]


def kill_host(namespace: str) -> int:
    """A compute host dies: every process of its network namespace (its slurmd, each job's slurmstepd and
    processes) killed at once. How many there were."""
    pids = run("ip", "netns", "pids", namespace).split()
    subprocess.run(["kill", "-9", *pids], capture_output=True)
    return len(pids)


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def node_state(node: str) -> str:
    return run("sinfo", "-h", "-n", node, "-o", "%T").strip()


def test_a_compute_host_that_dies_mid_training_costs_only_the_steps_since_its_last_checkpoint(hosts, tmp_path):
    """A finished study's run trained again (`rerun=<run id>`), and the compute host running it dies mid-training:
    its slurmd and all its processes killed. SLURM marks the node down and requeues the job on another host, where
    the run resumes from its last checkpoint; the study completes with its run's metrics and table the clean
    run's, digit for digit, every step once in MLflow."""
    from test_slurm import SLURM, SMALL, SMALL_RUNS, comparable, scontrol_field, write_config
    from test_tracking import child_runs, client

    config = json.loads(json.dumps(SMALL))
    config["grid"]["baseline"] = False
    steps, every = 300, 25
    config["run"]["train"].update(steps=steps, prompts_per_step=16, group_size=4)
    config["run"]["checkpoint"]["every"] = every
    name = SMALL_RUNS[0]
    config_file = write_config(tmp_path, config)
    env = cold_environment(dict(os.environ))  # jobs on other hosts: no zygote of this one
    snakemake = [*SNAKEMAKE, *SLURM, "--directory", str(tmp_path), "--configfile", str(config_file)]
    clean = subprocess.run(snakemake, capture_output=True, text=True, timeout=1200, env=env)
    assert clean.returncode == 0, clean.stderr[-4000:]
    results, run_dir = tmp_path / "results", tmp_path / "results" / "runs" / name
    clean_metrics, clean_table = comparable(run_dir), (results / "tables" / "results.md").read_text()

    timeline, killed_at = [], None
    started = time.monotonic()

    def note(event: str) -> None:
        timeline.append(f"{time.monotonic() - started:5.1f} s  {event}")

    log = tmp_path / "rerun.log"
    with log.open("w") as handle:
        process = subprocess.Popen([*snakemake, "--config", f"rerun={name}"], stdout=handle, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while killed_at is None and time.monotonic() < deadline and process.poll() is None:
            lines = lines_of(run_dir / "metrics.jsonl")
            training = [job for job in squeue_jobs() if job["Name"] == "smk-train" and job["State"] == "RUNNING"]
            if training and lines >= 2 * every + 5:  # two checkpoints behind it, the third on its way
                [job] = training
                host = job["NodeList"]
                processes = kill_host(f"klstudy-{host}")
                killed_at = lines_of(run_dir / "metrics.jsonl")
                note(f"host {host} killed ({processes} processes) with job {job['JobID']} at step {killed_at}")
            time.sleep(0.1)
        assert killed_at is not None, f"the training never ran long enough to be killed: {log.read_text()[-3000:]}"
        assert killed_at < steps, "the run finished before its host was killed"
        while node_state(host) not in ("down", "down*") and time.monotonic() < deadline:
            time.sleep(0.5)
        note(f"node {host}: {node_state(host)}")
        while time.monotonic() < deadline:
            again = [j for j in squeue_jobs() if j["JobID"] == job["JobID"] and j["State"] == "RUNNING"]
            if again:
                note(f"job {job['JobID']} running again on {again[0]['NodeList']} "
                     f"(restarts: {scontrol_field(job['JobID'], 'Restarts')})")
                assert again[0]["NodeList"] != host
                break
            time.sleep(0.5)
        assert process.wait(timeout=900) == 0, log.read_text()[-4000:]
        note("the study complete")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=120)
        cluster("up", "--hosts", str(len(HOSTS)))  # the dead host back, for the tests after this one

    train_log = (run_dir / "train.log").read_text()
    resumed = [int(step) for step in re.findall(r"resumed from checkpoint step_(\d+)", train_log)]
    print("\n" + "\n".join(timeline) + f"\nresumed at step {resumed}")
    assert resumed and killed_at - every <= resumed[-1] <= killed_at, (resumed, killed_at)
    assert comparable(run_dir) == clean_metrics  # each step once, as the clean run's
    assert (results / "tables" / "results.md").read_text() == clean_table
    [child], _ = child_runs(f"sqlite:///{results / 'mlflow.db'}", config["study"])
    history = client(f"sqlite:///{results / 'mlflow.db'}").get_metric_history(child.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(steps))  # each step once


def job_state(job: str) -> str:
    return (run("sacct", "-X", "-n", "-P", "-o", "State", "-j", job).split() or ["UNKNOWN"])[0]


@pytest.mark.parametrize("moment", ["starting", "busy"])
def test_slurms_sigterm_to_a_jobs_processes_leaves_every_reward_of_its_verifier_right(hosts, tmp_path, moment):
    """SLURM stops a job with SIGTERM to its processes (`scancel --signal=TERM --full`, as the executor's own
    SIGTERM reaches the job command's process group): the verifier's workers get it too, while they start
    (importing sympy) or while calls are in flight. On a compute host, a verifier pool scoring slow calls
    (tests/test_verify.py's scorer, which finishes its batch on SIGTERM as the trainer finishes its step) must
    score every known answer right."""
    from test_verify import SCORER, SLOW_PAIRS

    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "score.sh"
    script.write_text(f"#!/bin/sh\ncd {shlex.quote(str(REPO))}\nexec {sys.executable} -c {shlex.quote(SCORER)}\n")
    cold = cold_environment(dict(os.environ))
    env = {**cold, "KLSTUDY_TEST_MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), cold["PYTHONPATH"]]))}
    out = tmp_path / "job.out"
    job = subprocess.run(["sbatch", "--parsable", "--nodelist=cn2", "--cpus-per-task=2", "--mem=2000M",
                          f"--output={out}", str(script)], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    try:
        deadline = time.monotonic() + 180
        while not any(path.name.startswith(moment) for path in marks.iterdir()):
            assert time.monotonic() < deadline and job_state(job) in ("PENDING", "RUNNING", "UNKNOWN"), \
                (job_state(job), out.read_text() if out.is_file() else "")
            time.sleep(0.02)
        run("scancel", "--signal=TERM", "--full", job)
        while job_state(job) in ("PENDING", "RUNNING", "UNKNOWN"):
            assert time.monotonic() < deadline + 300, "the scorer did not finish after SIGTERM"
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], capture_output=True)  # a failed test leaves no job for the next
    assert job_state(job) == "COMPLETED", out.read_text()
    result = json.loads(out.read_text().strip().splitlines()[-1])
    assert result["sigterms"] == 1  # the scorer itself got SLURM's SIGTERM
    assert result["scores"] == [score for _, _, score in SLOW_PAIRS], result["counts"]


# --- up and down, last: they switch to the one-node cluster and back, then take every host away ------

def leftovers() -> list[str]:
    """What a cluster of hosts leaves: namespaces, links, /etc/hosts's block, /etc/netns files, slurmd."""
    found = [f"namespace {line.split()[0]}" for line in run("ip", "netns", "list").splitlines()
             if line.split()[0] in NAMESPACES]
    links = [line.split(": ")[1].split("@")[0] for line in run("ip", "-o", "link", "show").splitlines()]
    found += [f"link {name}" for name in links if name.startswith("klstudy")]
    found += ["/etc/hosts block"] if HOSTS_MARKER in Path("/etc/hosts").read_text() else []
    found += [str(path) for path in Path("/etc/netns").glob("klstudy-*")] if Path("/etc/netns").exists() else []
    return found


def test_up_without_hosts_is_the_one_node_cluster_again(hosts):
    cluster("up")
    assert run("sinfo", "-h", "-N", "-o", "%N %t").split() == ["localhost", "idle"]
    assert run("srun", "hostname", timeout=60).strip() == os.uname().nodename
    assert leftovers() == []


def test_down_leaves_no_host_behind(hosts):
    cluster("up", "--hosts", str(len(HOSTS)))
    assert leftovers() != []
    cluster("down")
    assert leftovers() == []
    assert subprocess.run(["pgrep", "-x", "slurmd"], capture_output=True).returncode == 1  # none runs
