"""A study grown and repaired as researchers do, locally and through profiles/slurm: Snakemake killed
at three moments, seeds added, a run that fails inside a bundle and is rerun. Nothing finished is
ever opened again (every file keeps its bytes and mtime), new grid points run alone, and failed
points rerun alone. The model-free parts (the plan of pending work and its bundles, discarding
points, the status) are tested on synthetic run directories."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_slurm import SLURM, squeue
from test_workflow import LOCAL, SNAKEMAKE, from_prepared, write_config

from sweep.study import changes, jobs, rerun, status
from sweep.study.checks import StudyError
from sweep.study.evaluations import Expected
from sweep.study.grid import load_study
from sweep.study.study_check import preflight
from trainer.run_files import COMPLETE, read_metrics

REPO = Path(__file__).resolve().parent.parent

# The quick toy study (jobs of two runs and of three evaluations) with runs of twelve steps of 32 prompts
# x 8, each evaluated at step 6 and at the end: long enough for Snakemake to be killed at the moments it
# must be, also while SLURM runs its jobs on.
QUICK = yaml.safe_load((REPO / "workflow" / "config" / "toy_quick.yaml").read_text())
HEALING = {**QUICK, "study": "toy-heal", "results": "results", "run": {**QUICK["run"], "train": {
    **QUICK["run"]["train"], "steps": 12, "prompts_per_step": 32, "group_size": 8}},
    "evaluate": {**QUICK["evaluate"], "every": 6}}
STEPS = 12
RUNS = ["toy-sft__k1-reward__b0.1__s0", "toy-sft__k3-reward__b0.1__s0", "toy-sft__k3-loss__b0.1__s0",
        "toy-sft__none__s0"]
GROWN = [name.replace("__s0", "__s1") for name in RUNS]


def study_of(config: dict, results: Path):
    return load_study({**config, "results": str(results)})


# --- synthetic run directories (no model, no Snakemake) ------------------------------------------


def finish(results: Path, run: str, evals: tuple[str, ...] = ("toy", "step_6/toy"), config: dict = HEALING) -> None:
    """A run directory as the trainer leaves a finished run, and its evaluations as the study's jobs would
    record them (eval.provenance, as the study of `config` gives them)."""
    directory = results / "runs" / run
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(STEPS)))
    (directory / COMPLETE).write_text(json.dumps({"steps": STEPS, "finished": time.time()}) + "\n")
    expected = Expected(study_of(config, results))
    for where in evals:
        step, _, suite = where.rpartition("/")
        target = jobs.EvalTarget(run, int(step[5:]) if step else None, suite)
        (results / "eval" / run / where).mkdir(parents=True, exist_ok=True)
        (results / "eval" / run / where / "metrics.json").write_text(json.dumps({"provenance": expected(target)}))


def test_only_pending_work_is_planned_and_a_bundle_keeps_its_name_while_it_has_work(tmp_path):
    study = study_of(HEALING, tmp_path)
    first = jobs.plan(study, record=True)
    assert first.runs == RUNS and [b.pending for b in first.train_bundles] == [tuple(RUNS[:2]), tuple(RUNS[2:])]
    assert [len(b.pending) for b in first.evaluate_bundles] == [3, 3, 2]  # 8 evaluations, in grid order
    assert sorted(p.stem for p in jobs.ledger(study, "train").glob("*.json")) == sorted(
        b.key for b in first.train_bundles)

    finish(tmp_path, RUNS[0])  # a job was killed after its first run finished
    again = jobs.plan(study, record=True)
    assert again.runs == RUNS[1:]
    # Snakemake sees the finished run through a file of its own, none for the others
    assert [again.done("train", run).exists() for run in RUNS] == [True, False, False, False]
    assert again.done("evaluate", f"{RUNS[0]}/step_6/toy").exists()
    assert [(b.name, b.pending) for b in again.train_bundles] == [
        (first.train_bundles[0].name, (RUNS[1],)), (first.train_bundles[1].name, tuple(RUNS[2:]))]
    # a job started on a compute node reads the same jobs back, whatever it plans itself
    assert set(jobs.recorded(study).train_bundles) == set(again.train_bundles)
    assert set(jobs.recorded(study).evaluate_bundles) == set(again.evaluate_bundles)
    # and still finds its own job once that job's work is finished: SLURM requeued it as its run completed
    finish(tmp_path, RUNS[1])
    in_job = jobs.recorded(study)
    assert set(in_job.train_bundles) == set(again.train_bundles) and RUNS[1] in in_job.runs
    assert {t.key for t in in_job.evaluations} == {t.key for t in jobs.evaluations(study)}
    assert [b.pending for b in jobs.plan(study, record=True).train_bundles] == [tuple(RUNS[2:])]
    assert [b.pending for b in jobs.recorded(study).train_bundles] == [tuple(RUNS[2:])]  # the next plan's

    for run in RUNS:
        finish(tmp_path, run)
    grown = study_of({**HEALING, "grid": {**HEALING["grid"], "seeds": [0, 1]}}, tmp_path)
    work = jobs.plan(grown, record=True)
    assert work.runs == GROWN  # the new seed's points alone, in new bundles
    assert [b.pending for b in work.train_bundles] == [tuple(GROWN[:2]), tuple(GROWN[2:])]
    assert {b.name for b in work.train_bundles}.isdisjoint(b.name for b in first.train_bundles)
    assert [t.run for t in work.evaluations] == [run for run in GROWN for _ in range(2)]
    assert len(list(jobs.ledger(grown, "train").glob("*.json"))) == 2  # the finished bundles are forgotten

    dry = jobs.plan(study_of({**HEALING, "grid": {**HEALING["grid"], "seeds": [0, 1, 2]}}, tmp_path), record=False)
    assert len(dry.train_bundles) == 4 and len(list(jobs.ledger(grown, "train").glob("*.json"))) == 2


def test_a_recorded_bundle_that_no_longer_fits_the_study_is_planned_again(tmp_path):
    study = study_of(HEALING, tmp_path)
    jobs.plan(study, record=True)
    smaller = study_of({**HEALING, "bundle": {"train": 1, "evaluate": 3}}, tmp_path)
    work = jobs.plan(smaller, record=True)
    assert work.train_bundles == [] and work.runs == RUNS  # a job per run, named by the rule's wildcard
    assert not list(jobs.ledger(study, "train").glob("*.json"))  # no stale bundle to define a second rule
    assert jobs.only(["a.b", "c"]) == r"a\.b|c" and re.fullmatch(jobs.only([]), "") is None


def test_rerun_moves_the_chosen_points_aside_and_refuses_what_it_cannot_do(tmp_path):
    study = study_of(HEALING, tmp_path)
    for run in RUNS[:3]:
        finish(tmp_path, run)
    with pytest.raises(StudyError, match=r"toy-sft__k1-reward__b0\.2__s0 is neither a grid point nor an evaluation.*"
                                         r"did you mean toy-sft__k1-reward__b0\.1__s0.*nothing was discarded"):
        rerun.discard(study, f"{RUNS[1]},toy-sft__k1-reward__b0.2__s0")
    assert (tmp_path / "runs" / RUNS[1] / COMPLETE).is_file()  # nothing moved

    (tmp_path / "runs" / RUNS[3]).mkdir(parents=True)  # a trainer on this host holds it now
    (tmp_path / "runs" / RUNS[3] / "lease.0.json").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}))
    with pytest.raises(StudyError, match=f"{RUNS[3]} is being trained now, by pid {os.getpid()}"):
        rerun.discard(study, [RUNS[0], RUNS[3]])
    assert (tmp_path / "runs" / RUNS[0] / COMPLETE).is_file()

    child = tmp_path / "runs" / RUNS[0] / ".mlflow" / "store1"  # where an older klstudy kept its sync records
    child.mkdir(parents=True)
    (child / "child.0.json").write_text(json.dumps({"run_id": "old-child"}))
    would = rerun.discard(study, RUNS[0], dry_run=True)
    assert (would.runs, would.evaluations) == ([RUNS[0]], []) and (tmp_path / "runs" / RUNS[0]).is_dir()
    assert rerun.discard(study, RUNS[0]).runs == [RUNS[0]]
    [moved] = (tmp_path / "discarded").iterdir()
    assert (moved / "runs" / RUNS[0] / COMPLETE).is_file() and (moved / "eval" / RUNS[0] / "toy").is_dir()
    assert not (tmp_path / "eval" / RUNS[0]).exists()
    retired = tmp_path / "tracking" / "runs" / RUNS[0] / ".mlflow" / "store1" / "retired.json"
    assert json.loads(retired.read_text()) == ["old-child"]  # the next sync deletes it
    assert not (tmp_path / "runs" / RUNS[0]).exists()  # nothing was written where the run was
    assert not jobs.plan(study, record=False).done("train", RUNS[0]).exists()
    assert jobs.plan(study, record=False).runs == [RUNS[0], RUNS[3]]
    assert rerun.chosen(study, "failed") == ([], [])

    # an evaluation by its key: only it moves, and its run stays finished
    one = f"{RUNS[1]}/step_6/toy"
    assert rerun.chosen(study, f"{one},{RUNS[2]}/toy,{RUNS[2]}") == ([RUNS[2]], [one])  # the point holds its own
    assert one not in {target.key for target in jobs.plan(study, record=False).evaluations}
    assert one in {target.key for target in jobs.plan(study, record=False, redo_evaluations={one}).evaluations}
    time.sleep(1)  # another second: another bin
    assert rerun.discard(study, one).evaluations == [one]
    assert not (tmp_path / "eval" / one).exists() and (tmp_path / "eval" / RUNS[1] / "toy" / "metrics.json").is_file()
    assert [moved.name for moved in (tmp_path / "discarded").glob(f"*/eval/{one}")]
    assert (tmp_path / "runs" / RUNS[1] / COMPLETE).is_file() and RUNS[1] not in jobs.plan(study, record=False).runs
    assert one in {target.key for target in jobs.plan(study, record=False).evaluations}


def test_status_reads_every_point_from_its_run_directory(tmp_path):
    study = study_of(HEALING, tmp_path)
    finish(tmp_path, RUNS[0], evals=("toy",))
    failed = tmp_path / "runs" / RUNS[1]
    failed.mkdir(parents=True)
    (failed / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
    from trainer.run_files import record_failure

    record_failure(failed, "3 non-finite updates in a row", 4)
    running = tmp_path / "runs" / RUNS[2]
    running.mkdir(parents=True)
    (running / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    (running / "lease.3.json").write_text(json.dumps({"host": "gpu-node-7", "pid": 4242, "slurm_job": "812_3",
                                                      "heartbeat": time.time() - 12}))
    points = status.study_status(study)
    assert [p.state for p in points] == ["done", "failed", "running", "pending"]
    assert (points[0].evaluations_done, points[0].evaluations) == (1, 2)
    assert points[1].detail["reason"] == "3 non-finite updates in a row" and points[1].step == 4
    assert points[1].detail["log"] == str(failed / "train.log")
    assert points[2].detail["slurm_job"] == "812_3" and points[2].step == 1
    lines = status.report(study, points, ("failed", "running"))
    assert lines[0] == f"study toy-heal ({tmp_path}/): 4 points: 0 changed, 1 done, 1 failed, 1 running, 1 pending"
    assert len(lines) == 4 and "SLURM job 812_3" in lines[2] and "--config rerun=failed" in lines[3]
    (running / "lease.3.json").write_text(json.dumps({"host": "gpu-node-7", "heartbeat": time.time() - 3600}))
    assert status.study_status(study)[2].state == "pending"  # its holder stopped beating an hour ago

    cli = subprocess.run([sys.executable, "-m", "sweep", "status", "--configfile", str(write_config(tmp_path, {
        **HEALING, "results": str(tmp_path)})), "--json"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert [p["state"] for p in json.loads(cli.stdout)] == ["done", "failed", "pending", "pending"]


def test_outputs_made_otherwise_stop_the_study_with_the_keys_and_the_two_ways_on(tmp_path):
    """A run trained with another config, evaluations made with other settings or another data file's content:
    one error naming the outputs and the keys; status says `changed`; rerun=changed names exactly those; an
    evaluation whose run is gone is stale (redone with it, no stop)."""
    study = study_of(HEALING, tmp_path)
    for run in RUNS[:3]:
        finish(tmp_path, run)
    assert changes.survey(study) == changes.Survey() and preflight(study) is not None
    saved = dict(study.run(RUNS[0]).config, train={**study.run(RUNS[0]).config["train"], "steps": 4})
    (tmp_path / "runs" / RUNS[0] / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(StudyError, match=rf"^results: 1 run was made otherwise than the study says now "
                                         rf"\(train.steps: 4 there, 12 now; in {tmp_path}/runs/{RUNS[0]}\): restore "
                                         r"the study config, or run them again from scratch with --config "
                                         r"rerun=changed"):
        preflight(study)
    assert preflight(study, discarded=rerun.Discarded(runs=[RUNS[0]])) is not None

    more = study_of({**HEALING, "evaluate": {**HEALING["evaluate"], "samples": 3}}, tmp_path)
    with pytest.raises(StudyError, match=r"1 run was made .* and 4 evaluations were made otherwise than the study "
                                         r"says now \(evaluate.samples: 2 there, 3 now; in .*/eval/"
                                         rf"{RUNS[1]}/step_6/toy and 3 more\)"):
        preflight(more)
    survey = changes.survey(more)
    assert [c.output for c in survey.runs] == [RUNS[0]]  # its evaluations go with it, not listed apart
    assert survey.changed == [RUNS[0], *(f"{run}/{where}" for run in RUNS[1:3] for where in ("step_6/toy", "toy"))]
    assert rerun.chosen(more, "changed") == (survey.changed[:1], survey.changed[1:])
    points = status.study_status(more)
    assert [p.state for p in points] == ["changed", "changed", "changed", "pending"]
    assert points[1].detail["keys"] == {"evaluate.samples": (2, 3)}
    assert "rerun=changed" in status.report(more, points)[-1]

    data = tmp_path / "data" / f"{study.data_file('heldout').name}"  # the prepared file, edited by hand
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    for run in RUNS[1:3]:
        finish(tmp_path, run)  # evaluated from this content
    data.write_text('{"question": "1+2", "answer": "3"}\n')
    keys = changes.survey(study).evaluations[0].keys
    assert list(keys) == ["evaluate.data.arith"] and keys["evaluate.data.arith"][0].startswith("content ")

    warmed = {**HEALING, "models": {"toy-sft": {"build": {**HEALING["models"]["toy-sft"]["build"], "sft": {
        **HEALING["models"]["toy-sft"]["build"]["sft"], "steps": 300}}}}}  # another reference model
    keys = changes.survey(study_of(warmed, tmp_path)).runs[0].keys  # (its train.steps too, from above)
    assert keys["model.path"] == (str(study.model_dir("toy-sft")), str(study_of(warmed, tmp_path).model_dir("toy-sft")))

    shutil.rmtree(tmp_path / "runs" / RUNS[2])  # deleted by hand: its evaluations scored a model that is gone
    survey = changes.survey(study)
    assert survey.stale == [f"{RUNS[2]}/step_6/toy", f"{RUNS[2]}/toy"]
    assert f"{RUNS[2]}/toy" not in survey.changed


# --- the study itself, killed, grown and repaired ------------------------------------------------


def snapshot(results: Path) -> dict[str, tuple[str, int]]:
    """Every file of the finished runs and evaluations: digest and mtime. Their MLflow sync records apart,
    and a lease (the trainer that wrote COMPLETE drops it as it exits)."""
    roots = [p.parent for p in (results / "runs").glob(f"*/{COMPLETE}")]
    roots += [p.parent for p in (results / "eval").rglob("metrics.json")]
    files = {}
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and ".mlflow" not in path.parts and not path.name.startswith("lease."):
                files[str(path.relative_to(results))] = (hashlib.sha256(path.read_bytes()).hexdigest(),
                                                        path.stat().st_mtime_ns)
    return files


def changed(results: Path, kept: dict[str, tuple[str, int]]) -> list[str]:
    now = snapshot(results)
    return [path for path, seen in kept.items() if now.get(path) != seen]


def configfiles(config: Path | list[Path]) -> list[str]:
    """`--configfile` and the study's files: one, or a study and the override files merged over it."""
    return ["--configfile", *map(str, [config] if isinstance(config, Path) else config)]


def start(directory: Path, config: Path | list[Path], profile: list[str], log: str, *extra: str) -> subprocess.Popen:
    handle = (directory / log).open("w")
    return subprocess.Popen([*SNAKEMAKE, *profile, "--directory", str(directory), *configfiles(config), *extra],
                            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


class SlurmPause:
    """On SLURM a killed Snakemake's jobs go on, and on a loaded machine they could reach the next moment
    to kill at (or the study's end) before the next Snakemake had even started. So they are suspended
    (`scontrol suspend`, as an operator would) from the kill until the next Snakemake has built its DAG and
    is about to follow them: each moment is then still ahead of the Snakemake that is to be killed at it."""

    def __init__(self) -> None:
        self.jobs: list[str] = []

    def hold(self) -> None:
        running = [line.split()[0] for line in squeue() if line.split()[1] == "RUNNING"]
        self.jobs = [job for job in running if subprocess.run(["scontrol", "suspend", job]).returncode == 0]

    def release(self) -> None:
        for job in self.jobs:
            subprocess.run(["scontrol", "resume", job], check=False)  # one that was cancelled meanwhile
        self.jobs = []


def kill_when(process: subprocess.Popen, ready, progress, log: Path, pause: SlurmPause | None,
              timeout: float = 600) -> None:
    """SIGKILL Snakemake's process group (locally its jobs too; on SLURM they go on, held by `pause` until
    the next Snakemake selects its jobs) once it has started (or followed) its jobs and then
    `ready(progress at that moment)`."""
    deadline, since = time.monotonic() + timeout, None
    while since is None or not ready(since):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        if since is None and "Select jobs to execute" in log.read_text():
            since = progress()
            if pause is not None:
                pause.release()
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    if pause is not None:
        pause.hold()


def finish_study(directory: Path, config: Path | list[Path], profile: list[str],
                 *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *profile, "--directory", str(directory), *configfiles(config), *extra],
                          capture_output=True, text=True, timeout=1200)


def poison(source: Path, run_dir: Path) -> None:
    """A checkpoint that passes the trainer's checks but whose weights are NaN: the run fails on resume."""
    import torch
    from safetensors.torch import load_file, save_file

    target = run_dir / "checkpoints" / source.name
    shutil.copytree(source, target)
    weights = target / "model" / "model.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})


def attempts(results: Path, run: str) -> int:
    log = results / "runs" / run / "train.log"
    return log.read_text().count("attempt started") if log.is_file() else 0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, prepared_toy_study):
    """The reduced study run once without interruption: its table is what every healed study must give."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    config = write_config(directory, HEALING)
    from_prepared(directory, prepared_toy_study)
    done = finish_study(directory, config, [*LOCAL])
    assert done.returncode == 0, done.stderr[-4000:]
    return (directory / "results" / "tables" / "results.md").read_text()


def grow_and_heal(directory: Path, profile: list[str], uninterrupted: str, prepared: Path) -> None:
    """The study from its prepare stage's outputs (conftest.prepared_toy_study) on: killed at three moments
    and run again, grown by a seed with one point made to fail, and repaired."""
    config = write_config(directory, HEALING)
    from_prepared(directory, prepared)
    results = directory / "results"
    runs = [results / "runs" / name for name in RUNS]
    kept: dict[str, tuple[str, int]] = {}

    def finished() -> int:
        return sum((r / COMPLETE).exists() for r in runs)

    def evaluated() -> int:
        return len(list((results / "eval").rglob("metrics.json")))

    def mid_bundle(before):  # a run mid-way, none finished
        return any((r / "checkpoints" / "step_3").is_dir() for r in runs) and not finished()

    def some_finished(before):  # a run finished while this Snakemake ran, another not yet
        return before[0] < finished() < len(runs)

    def evaluating(before):  # an evaluation job has started, and some evaluations are still to do
        return any((results / "logs" / "evaluate").glob("*.log")) and evaluated() < 2 * len(RUNS)

    pause = SlurmPause() if profile == SLURM else None
    try:
        for number, moment in enumerate((mid_bundle, some_finished, evaluating)):
            log = f"killed-{number}.log"
            kill_when(start(directory, config, profile, log), moment, lambda: (finished(), evaluated()),
                      directory / log, pause)
            kept |= {path: seen for path, seen in snapshot(results).items() if path not in kept}
    finally:
        if pause is not None:
            pause.release()
    healed = finish_study(directory, config, profile)
    assert healed.returncode == 0, healed.stderr[-5000:]
    if profile == SLURM:  # the jobs of a killed Snakemake were followed by the next, not submitted again
        logs = "".join((directory / f"killed-{n}.log").read_text() for n in (1, 2)) + healed.stderr
        assert re.search(r"SLURM job \S+ \(train_\w+\) of an earlier run of this study still runs: followed", logs)
    assert kept and not changed(results, kept)  # bytes and mtimes
    for run in RUNS:
        assert [m["step"] for m in read_metrics(results / "runs" / run / "metrics.jsonl")] == list(range(STEPS))
    assert (results / "tables" / "results.md").read_text() == uninterrupted
    assert "Nothing to be done" in finish_study(directory, config, profile, "-n").stdout

    # Two more seeds' worth of points, one of which will fail: a checkpoint of NaN weights to resume from.
    grown = write_config(directory, {**HEALING, "grid": {**HEALING["grid"], "seeds": [0, 1]}})
    poison(results / "runs" / RUNS[2] / "checkpoints" / "step_6", results / "runs" / GROWN[2])
    kept = snapshot(results)
    dry = finish_study(directory, grown, profile, "-n", "--quiet", "rules")
    assert dry.returncode == 0, dry.stderr[-3000:]
    planned = dict(re.findall(r"^(\w+)\s+(\d+)$", dry.stdout, re.M))
    assert sum(int(n) for rule, n in planned.items() if rule.startswith("train_")) == 2  # 4 new runs, 2 per job
    assert sum(int(n) for rule, n in planned.items() if rule.startswith("evaluate_")) == 3  # 8 new evaluations
    before = os.times()
    failing = finish_study(directory, grown, profile)
    cpu = sum(os.times()[2:4]) - sum(before[2:4])  # locally: the jobs' too; on SLURM, Snakemake's alone
    assert failing.returncode != 0
    assert not changed(results, kept)
    assert [(results / "runs" / run / COMPLETE).exists() for run in GROWN] == [True, True, False, True]
    shown = subprocess.run([sys.executable, "-m", "sweep", "status", "--configfile", str(grown)], cwd=directory,
                           capture_output=True, text=True)
    assert "8 points: 0 changed, 7 done, 1 failed, 0 running, 0 pending" in shown.stdout, shown.stdout + shown.stderr
    failed_line = next(line for line in shown.stdout.splitlines() if line.startswith("  failed"))
    log = results / "runs" / GROWN[2] / "train.log"
    assert GROWN[2] in failed_line and f"log: {log.relative_to(directory)}" in failed_line
    assert "not finite" in log.read_text()

    kept = snapshot(results)
    fixed = finish_study(directory, grown, profile, "--config", "rerun=failed")
    assert fixed.returncode == 0, fixed.stderr[-5000:]
    assert f"klstudy rerun: 1 point(s) and 0 evaluation(s) discarded, to run again from scratch: {GROWN[2]}" in \
        fixed.stderr
    assert not changed(results, kept)
    assert attempts(results, GROWN[2]) == 1  # a new run directory, trained from scratch once
    assert [m["step"] for m in read_metrics(results / "runs" / GROWN[2] / "metrics.jsonl")] == list(range(STEPS))
    assert len(re.findall(r"^(?:local)?rule train_\w+:", fixed.stderr, re.M)) == 1
    table = (results / "tables" / "results.md").read_text()
    assert table != uninterrupted and "k3-loss" in table
    print(f"\nadding a seed: {sum(int(n) for r, n in planned.items() if r.startswith(('train_', 'evaluate_')))} "
          f"train and evaluate jobs planned, {cpu:.0f} CPU-seconds")


@pytest.mark.slow
def test_the_study_killed_three_times_grown_and_repaired_locally(tmp_path, uninterrupted, prepared_toy_study):
    grow_and_heal(tmp_path, [*LOCAL], uninterrupted, prepared_toy_study)


@pytest.mark.slow
def test_the_study_killed_three_times_grown_and_repaired_on_slurm(slurm, tmp_path, uninterrupted,
                                                                  prepared_toy_study):
    grow_and_heal(tmp_path, SLURM, uninterrupted, prepared_toy_study)


# The quick toy study with runs of eight steps of 16 prompts x 4, a checkpoint every two: long enough to be killed
# mid-way, short enough to be trained again whole.
SHORT = {**QUICK, "study": "toy-grown", "results": "results", "run": {**QUICK["run"], "train": {
    **QUICK["run"]["train"], "steps": 8, "prompts_per_step": 16}, "checkpoint": {"every": 2}},
    "evaluate": {**QUICK["evaluate"], "every": 4}}


def test_a_study_grown_by_an_override_file_killed_goes_on_and_reruns_exactly_what_changed(tmp_path,
                                                                                          prepared_toy_study):
    """Grown by a beta through an override file (`--configfile study.yaml grown.yaml`) and SIGKILLed mid-way, the
    study goes on with the same command; `-n` and `--unlock` work on the killed study (its dead Snakemake's lock is
    released with both files); after a change to train.steps, `rerun=changed` trains exactly the changed points
    again, and nothing else."""
    base = write_config(tmp_path, SHORT)
    from_prepared(tmp_path, prepared_toy_study)
    first = finish_study(tmp_path, base, LOCAL)
    assert first.returncode == 0, first.stderr[-4000:]
    grown = tmp_path / "grown.yaml"
    grown.write_text(yaml.safe_dump({"grid": {"betas": [0.1, 0.2]}}))
    study, results = [base, grown], tmp_path / "results"
    new = [run.replace("b0.1", "b0.2") for run in RUNS[:3]]  # the no-KL baseline has no beta

    def mid_way(before):  # a new point has a checkpoint, and not every new point is finished
        return (any((results / "runs" / run / "checkpoints").is_dir() for run in new)
                and not all((results / "runs" / run / COMPLETE).exists() for run in new))

    kill_when(start(tmp_path, study, LOCAL, "killed.log"), mid_way, lambda: 0, tmp_path / "killed.log", None)
    left = tmp_path / ".snakemake" / "klstudy-lock-holder.json"
    assert left.is_file()  # its holder is dead, its lock is still there
    killed_state = tmp_path / "killed-state"
    shutil.copytree(tmp_path / ".snakemake", killed_state, ignore=shutil.ignore_patterns("conda*", "log"))

    dry = finish_study(tmp_path, study, LOCAL, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "is no longer running and did not clean up: its lock, if any, is released" in dry.stderr
    assert re.search(r"runs: \d start fresh, \d resume from a checkpoint, \d finished", dry.stdout)
    shutil.rmtree(tmp_path / ".snakemake" / "locks", ignore_errors=True)
    shutil.copytree(killed_state, tmp_path / ".snakemake", dirs_exist_ok=True)  # as the kill left it, again
    unlocked = finish_study(tmp_path, study, LOCAL, "--unlock")
    assert unlocked.returncode == 0, unlocked.stderr[-3000:]
    assert not left.exists()

    went_on = finish_study(tmp_path, study, LOCAL)
    assert went_on.returncode == 0, went_on.stderr[-4000:]
    for run in RUNS + new:
        assert [m["step"] for m in read_metrics(results / "runs" / run / "metrics.jsonl")] == list(range(8)), run
    assert "Nothing to be done" in finish_study(tmp_path, study, LOCAL, "-n").stdout

    shorter = tmp_path / "shorter.yaml"
    shorter.write_text(yaml.safe_dump({"grid": {"betas": [0.1, 0.2]}, "run": {"train": {"steps": 6}}}))
    stopped = finish_study(tmp_path, [base, shorter], LOCAL, "-n")
    said = stopped.stdout + stopped.stderr  # a dry run's error goes to stdout
    assert stopped.returncode != 0 and "7 runs were made otherwise than the study says now (train.steps: 8 there, " \
        "6 now;" in said and "--config rerun=changed" in said
    planned = finish_study(tmp_path, [base, shorter], LOCAL, "-n", "--config", "rerun=changed")
    assert planned.returncode == 0, planned.stderr[-3000:]  # the plan says what the run will do
    assert "runs: 7 start fresh, 0 resume from a checkpoint, 0 finished" in planned.stdout
    kept = snapshot(results)
    ready = study_of(SHORT, results).model_ready("toy-sft")
    model = ready.stat().st_mtime_ns
    rerun_ = finish_study(tmp_path, [base, shorter], LOCAL, "--config", "rerun=changed")
    assert rerun_.returncode == 0, rerun_.stderr[-4000:]
    said = re.search(r"klstudy rerun: 7 point\(s\) and 0 evaluation\(s\) discarded, to run again from scratch: (.*)",
                     rerun_.stderr)
    assert said and sorted(said.group(1).split(", ")) == sorted(RUNS + new)
    trained = re.findall(r"--run \S+ (\S+/runs/\S+)", rerun_.stdout + rerun_.stderr)
    assert sorted(Path(path).name for path in trained) == sorted(RUNS + new)  # each once
    for run in RUNS + new:
        assert [m["step"] for m in read_metrics(results / "runs" / run / "metrics.jsonl")] == list(range(6)), run
    assert ready.stat().st_mtime_ns == model  # the reference model untouched
    assert set(changed(results, kept)) == set(kept)  # every run and evaluation made anew
    [moved] = (results / "discarded").iterdir()
    assert sorted(path.name for path in (moved / "runs").iterdir()) == sorted(RUNS + new)
    assert "Nothing to be done" in finish_study(tmp_path, [base, shorter], LOCAL, "-n").stdout
