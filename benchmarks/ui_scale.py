"""The MLflow runs page of a paper-sized study in a real Chromium: how long until a researcher sees its grid points.

    python benchmarks/ui_scale.py [--config workflow/config/paper.yaml] [--steps 10] [--keep DIR]

Every grid point of the study (paper.yaml: 333) is written as a finished run (`--steps` lines of metrics, each
evaluation's metrics.json), synced into a sqlite store as the track job syncs it, and served by `mlflow server`
as docs/mlflow_ui.md starts it. Debian's Chromium (Playwright drives it, as tests/test_mlflow_ui.py does) then
opens the study's runs page, the link the study prints. MLflow shows the first 100 runs ("100 matching runs"
for all 333) with a "Load more" button as the grid's last row, 100 more runs a click. The grid draws only the
rows near its scroll position, so after a click the button is not in the page until the grid is scrolled to
its end, as a person scrolls: a script that looks for it without scrolling finds nothing. Every wait here is
bounded and fails saying what the page showed. Once all are loaded, a window as tall as the grid draws every
row: each grid point must be a row, in name order, with every metric column (pass@1, `reward_mean`) filled.
Prints the sync's time and, from opening the page: the first rows drawn and every row loaded; the last line is
`ui_s=<time to every row>`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the UI tests' Chromium and grid reader, imported when used

from sweep.study import jobs  # noqa: E402
from sweep.study.evaluations import Expected  # noqa: E402
from sweep.study.grid import load_study  # noqa: E402
from sweep.tracking.experiment import LOCAL_UI, sync  # noqa: E402
from trainer.run_files import COMPLETE, METRICS  # noqa: E402

WAIT_MS = 120_000  # the longest any one step of the page may take
TO_BOTTOM = "() => { const grid = document.querySelector('.ag-body-viewport'); grid.scrollTop = grid.scrollHeight; }"
LINE = {"reward_mean": 0.5, "pass_rate": 0.5, "loss": 0.1, "kl_k3": 0.01, "grad_norm": 1.0, "lr": 1e-6,
        "step_time": 10.0}


def write_finished_study(config_file: Path, results: Path, steps: int) -> tuple[str, int]:
    """Every grid point a finished run of `steps` steps with its evaluations, as the jobs write them;
    (the study's name, the number of points)."""
    config = yaml.safe_load(config_file.read_text())
    config["results"] = str(results)
    config.setdefault("run", {}).setdefault("train", {})["steps"] = steps
    config["evaluate"] = {**config["evaluate"], "every": 0}
    study = load_study(config)
    expected = Expected(study)
    for run in study.runs:
        run_dir = results / "runs" / run.run_id
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(run.config))
        (run_dir / METRICS).write_text("".join(json.dumps({"step": s, **LINE}) + "\n" for s in range(steps)))
        (run_dir / COMPLETE).write_text(json.dumps({"steps": steps, "finished": time.time()}) + "\n")
    for target in jobs.evaluations(study):
        out = results / "eval" / target.key
        out.mkdir(parents=True)
        tasks = {task: {"metric": "pass@1", "value": 0.5, "stderr": 0.05, "n": 100}
                 for task in expected(target)["settings"]["tasks"]}
        (out / "metrics.json").write_text(json.dumps({"tasks": tasks, "provenance": expected(target)}))
    return study.name, len(study.runs)


def serve(store: Path, artifacts: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{store}",
                               "--artifacts-destination", str(artifacts)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server, port
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("mlflow server did not start")


def open_every_row(url: str, run_ids: list[str]) -> tuple[str, float, float, int]:
    """(the count the page shows first, seconds to the first rows drawn, seconds to every grid point loaded,
    clicks on Load more). Then checks every grid point is a row, by name, with every metric column filled."""
    from browser_required import PlaywrightTimeout, browser
    from test_mlflow_ui import READ_GRID, WIDE, close_assistant

    points = len(run_ids)
    with browser(viewport=WIDE) as context:  # wide: every column drawn, as tests/test_mlflow_ui.py reads them
        page = context.new_page()
        start = time.perf_counter()
        page.goto(url)
        count = page.get_by_text(re.compile(r"^[1-9]\d* matching runs$"))  # not the "0" shown while loading
        count.wait_for(timeout=WAIT_MS)
        page.locator(".ag-row[row-index]").first.wait_for(timeout=WAIT_MS)
        first_count, first = count.inner_text(), time.perf_counter() - start
        close_assistant(page)
        clicks, shown = 0, int(first_count.split()[0])
        while shown < points:
            # The button is the grid's last row and the grid draws only rows near its scroll position:
            # after a click it is out of the page until the grid is scrolled to its end, as a person does.
            page.evaluate(TO_BOTTOM)
            try:
                page.get_by_role("button", name="Load more", exact=True).click(timeout=WAIT_MS)
                clicks += 1
                shown = min(shown + 100, points)
                page.get_by_text(f"{shown} matching runs", exact=True).wait_for(timeout=WAIT_MS)
            except PlaywrightTimeout:
                raise RuntimeError(f"after {clicks} clicks on Load more the page shows {count.all_inner_texts()} "
                                   f"(expected {shown} of {points})") from None
        every = time.perf_counter() - start
        page.evaluate(TO_BOTTOM)
        assert not page.get_by_role("button", name="Load more").count(), "Load more is still there at the end"
        # A window as tall as the grid draws every row at once, for READ_GRID to read.
        height = page.evaluate("() => document.querySelector('.ag-body-viewport').scrollHeight")
        page.set_viewport_size({"width": WIDE["width"], "height": height + WIDE["height"]})
        with contextlib.suppress(PlaywrightTimeout):  # if never, the asserts below say what is drawn
            page.wait_for_function(f"() => ({READ_GRID})()[1].length >= {points}", timeout=WAIT_MS)
        headers, rows = page.evaluate(READ_GRID)
    names = [row.get("attributes.`Run Name`", "").split("\n")[-1] for row in rows]
    assert names == sorted(run_ids), f"{len(rows)} rows drawn, not the {points} grid points in name order"
    metrics = [col for col, _ in headers if col.startswith("metrics.")]
    assert "metrics.`reward_mean`" in metrics, metrics
    empty = [(name, col) for name, row in zip(names, rows, strict=True)
             for col in metrics if row.get(col, "-") in ("", "-")]
    assert not empty, f"{len(empty)} empty metric cells, e.g. {empty[:3]}"
    return first_count, first, every, clicks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "workflow" / "config" / "paper.yaml")
    parser.add_argument("--steps", type=int, default=10, help="metrics lines per run (default 10)")
    parser.add_argument("--keep", type=Path,
                        help="build everything in this new directory and keep it (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ui-scale-") as tmp:
        root = args.keep or Path(tmp)
        if args.keep and args.keep.exists():
            parser.error(f"--keep {args.keep}: it exists; name a new directory")
        name, points = write_finished_study(args.config, root / "results", args.steps)
        store = root / "server.db"
        start = time.perf_counter()
        synced = sync(root / "results", name, f"sqlite:///{store}")
        print(f"{points} grid points synced into sqlite in {time.perf_counter() - start:.1f} s "
              f"({synced.runs_created} child runs, {synced.steps_logged} steps)")
        server, port = serve(store, root / "artifacts")
        try:
            first_count, first, every, clicks = open_every_row(
                synced.runs_page.replace(LOCAL_UI, f"http://127.0.0.1:{port}"), sorted(synced.child_run_ids))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        print(f"runs page in Chromium: the first rows drawn in {first:.1f} s ({first_count!r}), "
              f"all {points} loaded in {every:.1f} s ({clicks} clicks on Load more), each a row with its metrics")
        print(f"ui_s={every:.1f}")


if __name__ == "__main__":
    main()
