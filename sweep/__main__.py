"""Command line of the study level: `python -m sweep track|report|status|fetch ...`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger("sweep")
DEFAULT_STUDY = Path("workflow/config/toy.yaml")  # the Snakefile's, where no --configfile is given


def main(argv: list[str] | None = None) -> int:
    from sweep.study import configfiles
    from trainer.objective import plugins

    try:
        plugins.load()  # before any registry is read: a plugin's names are valid in every study config
    except plugins.PluginError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m sweep", description="klstudy's study level")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("track", help="sync run directories into MLflow (idempotent)",
                       description="Brings MLflow up to date with results/runs and results/eval. Store: "
                       "--uri, else MLFLOW_TRACKING_URI, else sqlite:///<results>/mlflow.db.")
    t.add_argument("--results", type=Path, default=Path("results"))
    t.add_argument("--study", required=True, help="study name (one MLflow experiment and parent run)")
    t.add_argument("--uri", help="tracking URI")
    t.add_argument("--follow", type=Path, nargs="+", metavar="RUN_DIR",
                   help="sync only these runs (a training job's), every --interval s, until all are complete, or "
                        "until SIGUSR1 says their training is over; then once more")
    t.add_argument("--interval", type=float, default=30.0, help="seconds between syncs with --follow")
    t.add_argument("--open", action="store_true", help="only create the study's experiment and parent run (if "
                   "absent) and record them, as a study does before its training jobs start")
    r = sub.add_parser("report", help="tables (Markdown, LaTeX, CSV) and figures",
                       description="Writes results/tables and results/figures from the run directories.")
    r.add_argument("--results", type=Path, default=Path("results"))
    r.add_argument("--study", help="also log the tables and figures to this study's MLflow parent run")
    r.add_argument("--uri", help="tracking URI (with --study)")
    r.add_argument("--columns", action="append", default=[], metavar="AXIS",
                   help="also write tables/results_by_<AXIS>.md and .tex with this axis in the columns: model, "
                        "estimator, placement, beta or a swept config key (train.async_level, or async_level); "
                        "repeat for more. Every extra axis of the study gets one anyway")
    r.add_argument("--collapse-fraction", type=float, default=0.5,
                   help="a run whose smoothed reward or pass rate ends below this fraction of its peak is "
                        "flagged unstable (default 0.5)")
    s = sub.add_parser("status", help="every grid point: done, failed, running or pending",
                       description="Reads the study's run directories (nothing else) and prints each grid point's "
                       "state: done (with its evaluations), failed (the reason, the step, its log), running (the "
                       "lease holder, its SLURM job, the last step) or pending, with the counts.")
    configfiles.add_option(s, default=DEFAULT_STUDY)
    s.add_argument("--state", choices=("done", "failed", "running", "pending"), action="append", default=[],
                   help="list only the points in this state (repeatable; the counts cover every point)")
    s.add_argument("--json", action="store_true", help="print the points as JSON instead")
    f = sub.add_parser("fetch", help="a study's hub models and data sets into the Hugging Face cache",
                       description="Run on a node with the network (and the token of a gated model), before the "
                       "study's jobs, which run offline: downloads what the cache lacks, and says what it fetched.")
    configfiles.add_option(f, required=True)
    args = parser.parse_args(argv)
    ended = threading.Event()
    if args.command == "track" and args.follow:  # at once: the job may signal before MLflow is imported
        signal.signal(signal.SIGUSR1, lambda *_: ended.set())
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "track":
            from sweep.tracking.experiment import default_uri, follow, open_store, runs_page, sync

            # MLflow prints "View run ... at: <url>" on stdout when it ends a run on a server: stdout
            # is the sync report's JSON (the track job's output file), so everything else goes to stderr
            with contextlib.redirect_stdout(sys.stderr):
                if args.open:
                    uri = args.uri or default_uri(args.results)
                    store = open_store(args.results, args.study, uri)
                    synced = {"experiment_id": store.experiment_id, "parent_run_id": store.parent_id,
                              "runs_page": runs_page(uri, store.experiment_id)}
                elif args.follow:
                    follow(args.results, args.study, args.follow, args.uri, args.interval, ended=ended)
                    return 0
                else:
                    synced = sync(args.results, args.study, args.uri).__dict__
            print(json.dumps(synced))
        elif args.command == "status":
            from sweep.study import status

            study = _study(args.configfile or [DEFAULT_STUDY])
            points = status.study_status(study)
            print(json.dumps(status.records(points), indent=1) if args.json
                  else "\n".join(status.report(study, points, tuple(args.state))))
        elif args.command == "fetch":
            from sweep.hub.fetch import fetch_missing
            from sweep.hub.hub_needs import needs

            wanted = needs(_study(args.configfile))
            fetched = fetch_missing(wanted, say=lambda line: print(line, file=sys.stderr))
            print(f"klstudy fetch: {len(wanted)} hub model(s) and data set(s) cached, {len(fetched)} fetched now")
        else:
            from sweep.report.build import report

            with contextlib.redirect_stdout(sys.stderr):
                written = report(args.results, args.study, args.uri, args.collapse_fraction, tuple(args.columns))
            print(json.dumps(written))
    except ValueError as error:
        log.error("%s", error)
        return 2
    return 0


def _study(files: list[Path]):
    """The study that these config files make, merged in order as Snakemake merges them."""
    from sweep.study import configfiles
    from sweep.study.grid import load_study

    return load_study(configfiles.read(files))


if __name__ == "__main__":
    status = main()
    gc.freeze()  # the interpreter's last collections skip MLflow's, matplotlib's and SciPy's objects as it exits
    sys.exit(status)
