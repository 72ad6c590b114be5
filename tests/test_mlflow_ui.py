"""The MLflow UI as a researcher meets it: a real `mlflow server` on 127.0.0.1, a real Chromium, and
assertions on the rendered text. The study is the off-policy fixture (16 grid points, two extra axes,
the measured objective), synced into a sqlite store and served; the screenshots go to test-artifacts/
(docs/mlflow_ui.md shows two)."""

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from browser_required import PlaywrightTimeout, browser, require_browser, screenshot
from doc_recipes import linked_copy, recipe_block
from hub_server import stop_process, wait_until_answers
from study_fixture import write_offpolicy_study, write_study
from test_tracking import PASSWORD, free_port, start_server, stop_server

from sweep.report.build import report
from sweep.tracking.experiment import LOCAL_UI, sync

COLUMNS = ["klstudy.config_label", "klstudy.model", "klstudy.beta", "klstudy.objective.kl_loss_ratio",
           "klstudy.train.async_level", "klstudy.seed", "eval/all/arith/pass_at_1", "objective/gap", "objective/kl",
           "objective/reward", "reward_mean"]
WIDE = {"width": 2400, "height": 1000}  # every column on screen: the grid draws only the visible ones

# The grid as drawn: header cells in on-screen order (aria-colindex: the DOM keeps another order), and
# each row's cells by column id (the pinned run-name column and the others sit in separate containers).
READ_GRID = """() => {
  const headers = [...document.querySelectorAll('.ag-header-cell[col-id]')]
    .map(h => [Number(h.getAttribute('aria-colindex')), h.getAttribute('col-id'), h.innerText.trim()])
    .sort((a, b) => a[0] - b[0]);
  const rows = {};
  for (const cell of document.querySelectorAll('.ag-row[row-index] .ag-cell[col-id]')) {
    const index = cell.closest('.ag-row').getAttribute('row-index');
    (rows[index] = rows[index] || {})[cell.getAttribute('col-id')] = cell.innerText.trim();
  }
  return [headers.map(h => [h[1], h[2]]), Object.keys(rows).sort((a, b) => a - b).map(i => rows[i])];
}"""


def serve_study(tmp, write, *server_args, env=None):
    """(server process, sync report): the study synced and reported into a sqlite store, as `make study`
    leaves it, then served by `mlflow server` as `mlflow ui` would; the report's link points at it."""
    results = write(tmp / "results")
    store = f"sqlite:///{tmp / 'server.db'}"  # the store start_server serves
    synced = sync(results, "offpolicy", store)
    report(results, "offpolicy", store)
    port = free_port()
    process = start_server(tmp, port, *server_args, env=env)
    synced.runs_page = synced.runs_page.replace(LOCAL_UI, f"http://127.0.0.1:{port}")
    return process, synced


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_browser()  # before the slow part: skip (or fail in CI) at once
    process, synced = serve_study(tmp_path_factory.mktemp("ui"), write_offpolicy_study)
    try:
        yield synced
    finally:
        stop_server(process)


def close_assistant(page):
    """MLflow 3.17 opens its chat panel over a third of the window for a new browser; a person closes it."""
    close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    if close.count():
        close.first.click()


def open_landing_page(page, synced):
    page.goto(synced.runs_page)
    count = page.get_by_text(re.compile(r"^[1-9]\d* matching runs$"))  # not the "0" shown while loading
    count.wait_for()
    assert count.inner_text() == f"{len(synced.child_run_ids)} matching runs"  # the grid points, not their parent
    page.get_by_role("link", name=min(synced.child_run_ids), exact=True).wait_for()  # the rows drawn


def landing_page(page, synced, columns: list[str]) -> dict[str, dict[str, str]]:
    """Asserts what the landing page shows: every grid point a row, sorted by name (seeds side by side),
    `columns` in this order (coordinates first), in the training mode. Returns each row's cells by heading."""
    shown_in_order = f"""columns => JSON.stringify(({READ_GRID})()[0].map(h => h[1]).filter(h => columns.includes(h)))
                          === JSON.stringify(columns)"""
    with contextlib.suppress(PlaywrightTimeout):  # the grid draws after the count; if never, the assert says what
        page.wait_for_function(shown_in_order, arg=columns, timeout=30_000)
    headers, rows = page.evaluate(READ_GRID)
    headings = [text for _, text in headers]
    assert [h for h in headings if h in columns] == columns, headings
    shown = {}
    for row in rows:
        name = row["attributes.`Run Name`"].split("\n")[-1]
        shown[name] = {text: row[col] for col, text in headers if text in columns}
    assert list(shown) == sorted(synced.child_run_ids)
    sidebar = page.locator("nav").first.inner_text().split("\n")
    assert "Runs" in sidebar and not {"Sessions", "Judges", "Evaluation runs"} & set(sidebar)  # not GenAI's
    return shown


def test_the_landing_page_shows_every_grid_point_with_the_columns_that_matter(served):
    with browser(viewport=WIDE) as context:
        page = context.new_page()
        open_landing_page(page, served)
        rows = landing_page(page, served, COLUMNS)
    # k1-loss without the KL loss ratio at async level 2, seed 1: its coordinates and numbers
    cells = rows["toy__k1-loss__b0.1__async2__s1"]
    assert [cells[c] for c in COLUMNS[:6]] == ["k1-loss", "toy", "0.1", "none", "2", "1"]
    assert [round(float(cells[c]), 4) for c in COLUMNS[6:]] == [0.36, 0.476, 0.3, 0.45, 0.6]
    assert rows["toy__none__s0"]["klstudy.beta"] == "None" and rows["toy__none__s0"]["objective/gap"] == "-"
    with browser() as context:  # the docs' picture, at the window size of a laptop
        page = context.new_page()
        open_landing_page(page, served)
        close_assistant(page)
        screenshot(page, "mlflow_ui_landing")


def test_one_click_opens_a_grid_point_with_its_description_and_metric_charts(served):
    with browser() as context:
        page = context.new_page()
        open_landing_page(page, served)
        close_assistant(page)
        page.get_by_role("link", name="toy__k1-loss__b0.1__async2__s1", exact=True).click()
        page.get_by_text("The study's numbers").wait_for()  # its description says which charts answer
        assert "**k1-loss**" not in page.inner_text("body")  # rendered as Markdown, not shown as source
        screenshot(page, "mlflow_ui_grid_point")
        page.get_by_text("Model metrics", exact=True).first.click()
        page.wait_for_url(re.compile(r"/model-metrics"))
        for section in ("eval/all/arith", "objective"):
            page.get_by_text(section, exact=True).wait_for()
        page.locator(".js-plotly-plot").nth(2).wait_for()  # charts drawn, not placeholders
        screenshot(page, "mlflow_ui_grid_point_charts")
        # pass@1, then the objective's gap and KL, as a reader scrolls (charts draw when they come into view)
        titles: set[str] = set()
        page.mouse.move(900, 700)  # over the charts, which scroll in their own pane
        for _ in range(20):
            titles |= set(page.get_by_text(re.compile(r"^(pass_at_1|gap|kl)$")).all_inner_texts())
            if titles == {"pass_at_1", "gap", "kl"}:
                break
            page.mouse.wheel(0, 400)
            page.wait_for_timeout(250)
        assert titles == {"pass_at_1", "gap", "kl"}


def test_the_study_runs_description_is_the_results_table(served):
    with browser() as context:
        page = context.new_page()
        page.goto(served.runs_page.split("/runs?")[0] + f"/runs/{served.parent_run_id}")
        page.get_by_text("Show more").click()
        text = page.locator("table").first.inner_text()
        assert text.split("\n")[0].split("\t") == ["model", "beta", "kl_loss_ratio", "async_level", "configuration",
                                                  "seeds", "arith", "objective_gap", "kl_to_ref", "reward"]
        assert "toy\t0.1\tnone\t2\tk1-loss\t2\t0.355 ± 0.007*" in text  # the staleness cost, as in the report
        screenshot(page, "mlflow_ui_study_run")


def test_a_server_with_basic_auth_shows_the_study_after_login_and_refuses_without(tmp_path):
    """The basic-auth recipe of docs/guides/tracking.md: with the credentials the browser sees the landing page; without
    them, or with a wrong password, it gets the server's refusal, not an empty study."""
    require_browser()
    config = tmp_path / "basic_auth.ini"
    config.write_text(f"[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                      f"database_uri = sqlite:///{tmp_path / 'basic_auth.db'}\nadmin_username = admin\n"
                      f"admin_password = {PASSWORD}\n"
                      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    server_env = dict(os.environ, MLFLOW_AUTH_CONFIG_PATH=str(config), MLFLOW_FLASK_SERVER_SECRET_KEY="test-only")
    process, synced = serve_study(tmp_path, write_study, "--app-name", "basic-auth", env=server_env)
    try:
        with browser() as context:  # no credentials: Chromium gets the challenge; headless, it cannot ask
            page = context.new_page()
            statuses = []
            page.on("response", lambda response: statuses.append(response.status))
            with pytest.raises(Exception, match="ERR_INVALID_AUTH_CREDENTIALS"):
                page.goto(synced.runs_page)
            assert statuses == [401]  # the page itself refused: not one request of the study's went out
        with browser(http_credentials={"username": "admin", "password": PASSWORD + "x"}) as context:
            page = context.new_page()
            assert page.goto(synced.runs_page).status == 401
            assert page.inner_text("body").startswith("You are not authenticated.")
            screenshot(page, "mlflow_ui_refused")
        with browser(http_credentials={"username": "admin", "password": PASSWORD}) as context:
            page = context.new_page()
            open_landing_page(page, synced)
            rows = landing_page(page, synced, ["klstudy.config_label", "klstudy.model", "klstudy.beta", "klstudy.seed",
                                               "eval/all/math500/pass_at_1", "reward_mean"])
            assert rows["toy__k3-loss__b0.05__s1"]["eval/all/math500/pass_at_1"] == "0.4"
            close_assistant(page)
            screenshot(page, "mlflow_ui_logged_in")
    finally:
        stop_server(process)


# --- docs/mlflow_ui.md's recipe, as written ----------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "mlflow_ui.md"
RECIPE_MARKER = "<!-- recipe: the MLflow UI -->"
SSHD = "/usr/sbin/sshd"
NOT_LINKED = {".git", "results", ".snakemake", "site", "mlruns", "mlartifacts"}  # what the recipe writes


def recipe_lines() -> list[list[str]]:
    """The words of each line of docs/mlflow_ui.md's recipe, a trailing `&` (a server left running) dropped."""
    return [[w for w in shlex.split(line) if w != "&"] for line in recipe_block(GUIDE, RECIPE_MARKER)]


def require_sshd():
    """OpenSSH's server, for the tunnel a laptop opens; skipped without it, failed under KLSTUDY_REQUIRE_BROWSER=1
    (CI installs both)."""
    if not (os.path.exists(SSHD) and shutil.which("ssh")):
        if os.environ.get("KLSTUDY_REQUIRE_BROWSER") == "1":
            pytest.fail("KLSTUDY_REQUIRE_BROWSER=1 but no OpenSSH: apt-get install openssh-server openssh-client")
        pytest.skip("no OpenSSH server: apt-get install openssh-server openssh-client")


@contextlib.contextmanager
def login_node(tmp_path: Path):
    """An SSH server on 127.0.0.1 that stands for the cluster's login node: its port and the client's key."""
    keys = tmp_path / "ssh"
    keys.mkdir()
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    (keys / "authorized_keys").write_text((keys / "client.pub").read_text())
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege separation directory
    port = free_port()
    server = subprocess.Popen([SSHD, "-D", "-e", "-f", "/dev/null", "-p", str(port), "-h", str(keys / "host"),
                               "-o", "ListenAddress=127.0.0.1", "-o", f"AuthorizedKeysFile={keys / 'authorized_keys'}",
                               "-o", "StrictModes=no", "-o", "PidFile=none", "-o", "UsePAM=no"],
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "sshd.log").open("w"),
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # listening: a client started before would be refused
            assert server.poll() is None, f"sshd exited: {(tmp_path / 'sshd.log').read_text()}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"sshd did not listen: {(tmp_path / 'sshd.log').read_text()}"
                time.sleep(0.1)
        yield port, keys / "client"
    finally:
        stop_process(server)


def test_the_pages_recipe_opens_the_study_here_and_through_an_ssh_tunnel(tmp_path):
    """docs/mlflow_ui.md's recipe, its lines as written, in a directory of its own (the repository's files linked
    into it): the quick toy study, `sweep track` printing the link, `mlflow ui` serving the study's store, and the
    laptop's tunnel to the login node (an SSH server on 127.0.0.1 in its place, reached with a key of the test's
    own; free ports in place of 5000). The printed link shows every grid point here and through the tunnel."""
    require_browser()
    require_sshd()
    study, track, ui, tunnel = recipe_lines()
    work = linked_copy(tmp_path / "work", NOT_LINKED)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ran = subprocess.run(study, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    printed = subprocess.run(track, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stderr[-3000:]
    link = re.search(r"the study's runs in MLflow: (\S+)", printed.stdout + printed.stderr)
    assert link and link.group(1).startswith("http://127.0.0.1:5000/#/experiments/"), printed.stderr[-2000:]

    port, laptop = free_port(), free_port()
    assert ui[:2] == [".venv/bin/mlflow", "ui"] and ui[-2:] == ["--port", "5000"]
    server = subprocess.Popen([*ui[:-1], str(port)], cwd=work, env=env, stdout=subprocess.DEVNULL,
                              stderr=(tmp_path / "ui.log").open("w"), start_new_session=True)
    processes = [server]
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/health", server, tmp_path / "ui.log", "mlflow ui", timeout=180)
        with login_node(tmp_path) as (ssh_port, key):
            assert tunnel == ["ssh", "-N", "-L", "5000:127.0.0.1:5000", "login-node"]
            forward = subprocess.Popen(
                [*tunnel[:3], f"{laptop}:127.0.0.1:{port}", "-p", str(ssh_port), "-i", str(key), "-o", "BatchMode=yes",
                 "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o",
                 "ExitOnForwardFailure=yes", "127.0.0.1"],
                stdout=subprocess.DEVNULL, stderr=(tmp_path / "ssh.log").open("w"), start_new_session=True)
            processes.append(forward)
            wait_until_answers(f"http://127.0.0.1:{laptop}/health", forward, tmp_path / "ssh.log", "the tunnel",
                               timeout=60)
            with browser() as context:
                for at in (port, laptop):  # here, then on the laptop's end of the tunnel
                    page = context.new_page()
                    page.goto(link.group(1).replace(":5000", f":{at}", 1))
                    shown = page.get_by_text(re.compile(r"^[1-9]\d* matching runs$"))
                    shown.wait_for()
                    assert shown.inner_text() == "4 matching runs", at  # toy_quick.yaml's four grid points
    finally:
        for process in reversed(processes):
            stop_process(process)
