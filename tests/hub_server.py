"""A real Hugging Face hub on 127.0.0.1 for the tests: olah (a self-hosted hub mirror) in its offline
mode, serving the git repositories of tests/hub_mirror.py, behind nginx, which asks for a token on
the gated repository. Clients reach it through HF_ENDPOINT alone (Hub.env).

    hub = start(tmp_dir, mirror)      # or the session fixture `hub` (tests/conftest.py)
    env = hub.env(tmp_dir / "hf")     # HF_ENDPOINT, a fresh HF_HOME, and no network but 127.0.0.1
    subprocess.run([..., "python", "-c", "from transformers import ..."], env=env)

Why nginx: olah checks no tokens in offline mode (it only forwards them to the upstream hub when
online), so the gated repository's token is asked for by nginx, in front of everything. olah is
installed in a virtual environment of its own (make setup: .venv-olah), since its dependencies
would downgrade the project's (fastapi-utils pins psutil below 6). DEVELOPERS.md, "A hub server for
tests: olah", has what we learned. Skipped where olah or nginx is missing, unless
KLSTUDY_REQUIRE_HUB=1 (set by .ci/run), where that fails the tests instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from hub_mirror import GATED_ID, MODEL_ID, STAND_INS, commits

ROOT = Path(__file__).resolve().parents[1]
OLAH = Path(os.environ.get("KLSTUDY_OLAH") or ROOT / ".venv-olah" / "bin" / "olah-cli")
NGINX = os.environ.get("KLSTUDY_NGINX") or shutil.which("nginx") or "/usr/sbin/nginx"
# The gated repository's token (a test secret of this local server, nothing else).
GATED_TOKEN = "hf_klstudy_test_hub_gated"
# Any request that is not to 127.0.0.1 goes to this proxy, where nothing listens: it fails at once.
NO_NETWORK = "http://127.0.0.1:9"


@dataclass(frozen=True)
class Hub:
    """A running hub. `endpoint` is what HF_ENDPOINT gets; `commits` maps "models/ORG/NAME" and
    "datasets/ORG/NAME" to the commit its `main` serves; `logs` holds olah's and nginx's logs (nginx's
    access log: one line per request)."""

    endpoint: str
    mirror: Path
    commits: dict[str, str]
    model_id: str = MODEL_ID
    stand_ins: tuple[str, ...] = STAND_INS
    gated_id: str = GATED_ID
    token: str = GATED_TOKEN
    logs: Path | None = None

    def env(self, hf_home: Path, offline: bool = False, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a client process: HF_ENDPOINT (this hub), HF_HOME (`hf_home`, where the
        hub, datasets and lm-eval caches go), and no network but 127.0.0.1 (`no_network`). `offline`:
        HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 as on a compute node, and HF_ENDPOINT a port where
        nothing listens."""
        env = no_network(os.environ if base is None else base, urllib.parse.urlsplit(self.endpoint).hostname)
        env.update(HF_ENDPOINT=NO_NETWORK if offline else self.endpoint, HF_HOME=str(hf_home))
        if offline:
            env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        return env


def no_network(base: dict[str, str], *hosts: str) -> dict[str, str]:
    """`base` without HF_* settings or tokens, and with every request that is not to 127.0.0.1 (or one of
    `hosts`) sent to a proxy where nothing listens, so that it fails at once."""
    env = {k: v for k, v in base.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        env[name] = env[name.upper()] = NO_NETWORK
    env["no_proxy"] = env["NO_PROXY"] = ",".join(dict.fromkeys(["127.0.0.1", "localhost", *hosts]))
    return env


def missing() -> str | None:
    """What is missing to run the hub, with the command that installs it; None if nothing is."""
    if not OLAH.is_file():
        return f"olah is not installed at {OLAH} (make setup installs it; or set KLSTUDY_OLAH)"
    if not Path(NGINX).is_file():
        return "nginx is not installed (apt-get install nginx; or set KLSTUDY_NGINX)"
    return None


def require_hub() -> None:
    """Skip (fail under KLSTUDY_REQUIRE_HUB=1) where the hub cannot run here, saying why."""
    problem = missing()
    if problem is not None:
        if os.environ.get("KLSTUDY_REQUIRE_HUB") == "1":
            pytest.fail(f"KLSTUDY_REQUIRE_HUB=1 but {problem}")
        pytest.skip(problem)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seed_olah_cache(repos: Path, mirror: Path, served: dict[str, str]) -> None:
    """Where each repository's `main` points, in olah's cache: resolved_commit.json as olah records it when
    it serves a branch online, and meta_head.json in the plain form its reader accepts. olah 0.5.4's
    offline mode resolves a branch only from this cache, never from the mirror: without it, a path
    missing under `main` is answered 401 RepoNotFound instead of 404 EntryNotFound (transformers'
    tokenizer asks for `additional_chat_templates` and fails), and the repository's info without a
    revision (/api/models/ORG/NAME) is 401 too."""
    for repo, sha in served.items():
        kind, hub_id = repo.split("/", 1)
        revision = repos / "api" / kind / hub_id / "revision" / "main"
        revision.mkdir(parents=True, exist_ok=True)
        (revision / "resolved_commit.json").write_text(json.dumps({"status_code": 200, "headers": {},
                                                                   "cached_at": time.time()}))
        (revision / "resolved_commit.json.body").write_text(sha)
        date = subprocess.run(["git", "-C", str(mirror / repo), "log", "-1", "--format=%cI", "main"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (revision / "meta_head.json").write_text(json.dumps({"sha": sha, "lastModified": date}))


def _olah_config(work: Path, address: str, port: int, mirror: Path) -> Path:
    config = work / "olah.toml"
    config.write_text(
        f'[basic]\nhost = "{address}"\nport = {port}\nrepos-path = "{work / "repos"}"\n'
        f'mirrors-path = ["{mirror}"]\n\n[accessibility]\noffline = true\n')
    return config


def _nginx_config(work: Path, address: str, port: int, olah_port: int, gated_id: str) -> Path:
    """nginx on `port` in front of olah; the gated repository's paths (/api/models/ID/..., /ID/resolve/...,
    /models/ID/...) need `Authorization: Bearer GATED_TOKEN`: none is 401, another 403, each with the
    X-Error-Code the hub sends for a gated repository (GatedRepo), so that clients name the cause."""
    message = (f"Access to model {gated_id} is restricted: klstudy's test hub serves it only with its "
               "token (tests/hub_server.py, GATED_TOKEN)")
    temp = "\n".join(f"    {kind}_temp_path {work / 'nginx' / kind};"
                     for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    config = work / "nginx.conf"
    config.write_text(f"""daemon off;
worker_processes 1;
pid {work / 'nginx.pid'};
error_log {work / 'nginx-error.log'} warn;
events {{ worker_connections 256; }}
http {{
    access_log {work / 'nginx-access.log'};
{temp}
    map $http_authorization $gated_status {{ "Bearer {GATED_TOKEN}" 200; "" 401; default 403; }}
    map $gated_status $gated_code {{ 200 ""; default GatedRepo; }}
    server {{
        listen {address}:{port};
        proxy_http_version 1.1;
        proxy_set_header Host $http_host;
        proxy_buffering off;
        proxy_request_buffering off;
        location ~ ^/(api/)?(models/)?{re.escape(gated_id)}(/|$) {{
            add_header X-Error-Code $gated_code always;
            if ($gated_status = 401) {{ return 401 "{message}\\n"; }}
            if ($gated_status = 403) {{ return 403 "{message}: that token is not it\\n"; }}
            proxy_pass http://{address}:{olah_port};
        }}
        location / {{ proxy_pass http://{address}:{olah_port}; }}
    }}
}}
""")
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (work / "nginx" / kind).mkdir(parents=True, exist_ok=True)
    return config


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.is_file() else f"(no {log})"


def _spawn(command: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_until_answers(url: str, process: subprocess.Popen, log: Path, what: str, timeout: float = 60) -> None:
    """Until `url` answers 200 (no proxy), failing with `log`'s tail if `process`, its server, exits first."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # whatever proxy this shell has
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {_tail(log)}")
        try:
            with direct.open(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s: {_tail(log)}")


def stop_process(process: subprocess.Popen, timeout: float = 15) -> None:
    """A server started in a session of its own: SIGTERM to its group, SIGKILL after `timeout` seconds."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout)


class Running:
    """olah and nginx, started by `start`; `stop()` ends both."""

    def __init__(self, hub: Hub, processes: list[subprocess.Popen]):
        self.hub, self.processes = hub, processes

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop_process(process)


def start(work: Path, mirror: Path, address: str = "127.0.0.1", namespace: str | None = None,
          name: str | None = None, port: int | None = None) -> Running:
    """olah (offline, serving `mirror`) and nginx in front of it, on free ports of `address` (nginx on `port` if
    given); returns once both answer. Their logs and olah's cache go to `work`. `namespace`: both run in that
    network namespace (the outside host of a cluster of hosts, profiles/slurm/local-cluster.sh), which this
    process reaches at `address`; clients then name the hub `name`."""
    work.mkdir(parents=True, exist_ok=True)
    served = commits(mirror)
    _seed_olah_cache(work / "repos", mirror, served)
    olah_port, port = free_port(), port or free_port()
    env = {**no_network(dict(os.environ)), "PYTHONUNBUFFERED": "1"}
    inside = ["ip", "netns", "exec", namespace] if namespace else []
    processes = []
    probe = f"api/models/{MODEL_ID}/revision/main"
    try:
        olah = [*inside, str(OLAH), "--config", str(_olah_config(work, address, olah_port, mirror)),
                "--log-path", str(work / "logs")]
        processes.append(_spawn(olah, work / "olah.log", env, work))
        wait_until_answers(f"http://{address}:{olah_port}/{probe}", processes[0], work / "olah.log", "olah")
        nginx = [*inside, NGINX, "-p", str(work), "-c", str(_nginx_config(work, address, port, olah_port, GATED_ID)),
                 "-e", str(work / "nginx-error.log")]
        processes.append(_spawn(nginx, work / "nginx.log", env, work))
        wait_until_answers(f"http://{address}:{port}/{probe}", processes[1], work / "nginx-error.log", "nginx")
    except BaseException:
        for process in reversed(processes):
            stop_process(process)
        raise
    return Running(Hub(f"http://{name or address}:{port}", mirror, served, logs=work), processes)


OUTSIDE = {"address": "10.87.1.2", "namespace": "klstudy-outside", "name": "klstudy-hub"}  # local-cluster.sh's


if __name__ == "__main__":  # a hub for a rehearsal by hand: python tests/hub_server.py [--outside] [--port N] DIR
    import argparse
    import sys

    from hub_mirror import mirror_tree
    from smollm2_required import require_smollm2

    parser = argparse.ArgumentParser(description="The test hub (olah behind nginx), serving SmolLM2-135M-Instruct "
                                     "as the paper's models and the paper's data sets, until Ctrl-C or SIGTERM.")
    parser.add_argument("directory", type=Path, help="its logs and olah's cache")
    parser.add_argument("--outside", action="store_true", help="on the outside host of profiles/slurm/"
                        "local-cluster.sh up --hosts N (klstudy-hub), not on 127.0.0.1")
    parser.add_argument("--port", type=int, help="nginx's port (default: a free one)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop both servers on kill too, starting ones included
    running = start(args.directory.resolve(), mirror_tree(require_smollm2()), port=args.port,
                    **(OUTSIDE if args.outside else {}))
    print(f"HF_ENDPOINT={running.hub.endpoint}  (gated {GATED_ID}: HF_TOKEN={GATED_TOKEN}); Ctrl-C stops it",
          flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
