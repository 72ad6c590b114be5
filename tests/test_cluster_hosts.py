"""A cluster of hosts on this machine (profiles/slurm/local-cluster.sh up --hosts 3): three compute hosts, each
a network namespace with its own hostname, address and slurmd, that reach the login host by its name and
nothing beyond their bridge; an outside host that only the login host reaches; and `up` and `down` that
take it all away again.

The module's fixture brings up three hosts and, at the end, gives back the cluster it found: the one-host
cluster up if it was up (CI runs the suite with it), or nothing. Needs root, `ip`, `unshare`, `nsenter`
and SLURM; without them these tests skip, unless KLSTUDY_REQUIRE_SLURM=1: then they fail.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import cluster_up, on_cluster

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
