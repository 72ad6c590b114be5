# train: one job per pending grid point, or `bundle.train` pending grid points per job (trained one after
# another in one process: `python -m trainer train-runs`). A job reads its runs' configs from the files the
# main process wrote as it planned (<results>/configs/<run id>.yaml, sweep.study.run_configs). The run directory
# is the state (sweep.study.jobs): a finished run (COMPLETE, which the trainer writes last) is in no job, so
# nothing reopens it; an interrupted one resumes from its newest valid checkpoint; a failed one records why (FAILED) without stopping the
# others of its job. Snakemake sees a run through its `.done` file (sweep.study.jobs), which the job writes when
# it succeeds: Snakemake never deletes or touches a run's own files. With live tracking (below), a follower streams the
# job's runs' metrics to the tracking server while they train. A job with several GPUs on one node runs the
# trainer under `accelerate launch`, one process per GPU; a job of several nodes (or CPU tasks) starts one
# process per GPU (or task) of every node as one SLURM job step (trainer.launch, trainer.srun).


import os
import subprocess

from sweep.study import run_configs

MODEL_READY = {run.run_id: STUDY.model_ready(run.model) for run in STUDY.runs}
CONFIG_FILE = {run.run_id: str(run_configs.config_file(STUDY, run.run_id)) for run in STUDY.runs}
if RUNS_JOBS:  # the pending runs' configs, each in the file its job reads (sweep.study.run_configs)
    run_configs.write(STUDY, WORK.runs)


def train_launcher(model):
    """The command that starts the trainer for `model`'s runs: one process, one per GPU of the job's node
    (accelerate launch), or, for several nodes or CPU tasks, one per GPU or task of every node (srun)."""
    resources = STUDY.resources_for("train", model)
    return shlex.join(job_command(PY, nodes=resources.get("nodes") or 1, gpus=resources.get("gpus") or 0,
                                  tasks=resources.get("tasks") or 1, cpus=resources.get("cpus") or 1))


# Live tracking: the study config's tracking.uri, else MLFLOW_TRACKING_URI. Each training job then starts
# a follower that syncs the job's own runs every 30 s (sweep.tracking.experiment.follow); the study's experiment and
# parent run are opened once, before any job starts (open_live_tracking, from the Snakefile's onstart).
LIVE_URI = STUDY.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")


FOLLOWER_LAST_ROUND_S = 60  # after training, a job tells its follower (SIGUSR1) and waits this long at most


def follower(followed="{params.follow}"):
    """The lines of a training job's shell command that start its follower, syncing `followed` (the job's
    run directories), and those that wait, after training, for its last round; none without live tracking.
    The follower gets tracking.uri, or else reads MLFLOW_TRACKING_URI in the job, which checks that it has it."""
    if not LIVE_URI:
        return "", ""
    uri = f"--uri {shlex.quote(STUDY.tracking_uri)} " if STUDY.tracking_uri else ""
    uri = uri.replace("{", "{{").replace("}", "}}")  # the shell command is a format string
    lines = [f"{{PY}} -m sweep track --results {{params.results}} --study {{params.study}} {uri}--follow {followed} \\",
             "    > {log.track} 2>&1 &", "follower=$!", 'trap "kill $follower 2>/dev/null || true" EXIT']
    if not STUDY.tracking_uri:
        lines = ['if [ -n "${{MLFLOW_TRACKING_URI:-}}" ]; then', *(f"    {line}" for line in lines), "fi"]
    wait = (f'[ -z "${{{{follower:-}}}}" ] || {{{{ kill -USR1 "$follower" && timeout {FOLLOWER_LAST_ROUND_S} '
            'tail --pid="$follower" -f /dev/null; }} || true')
    return "".join(f"\n        {line}" for line in lines) + "\n", f"        {wait}\n"


def open_live_tracking():
    """The study's experiment and parent run, before any training job starts (followers then find them in
    their record). A server that refuses this client or does not answer stops the study here, with one
    error. One that is still starting (the SLURM recipe starts it in the same shell, a moment before) gets
    about a minute: MLflow's 5 retries wait 0, 4, 8, 16 and 32 s."""
    if not LIVE_URI:
        return
    command = [PY, "-m", "sweep", "track", "--results", str(RESULTS), "--study", STUDY.name, *_uri_args(), "--open"]
    opened = subprocess.run(command, capture_output=True, text=True,
                            env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5", **os.environ})
    if opened.returncode != 0:
        lines = opened.stderr.strip().splitlines() or ["(no output)"]
        raise WorkflowError(f"live tracking: {lines[-1].removeprefix('ERROR sweep: ')}")
    print(f"MLflow, the study's runs (live): {json.loads(opened.stdout)['runs_page']}", file=sys.stderr)


if STUDY.bundle["train"] == 1:

    rule train:
        input:
            model=lambda wc: MODEL_READY[wc.run],
        output:
            WORK.done("train", "{run}"),
        wildcard_constraints:
            run=jobs.only(WORK.runs),  # the main process submits no finished run
        params:
            out=f"{RESULTS}/runs/{{run}}",  # a string: Snakemake fills wildcards into strings only
            follow=f"{RESULTS}/runs/{{run}}",
            config=lambda wc: CONFIG_FILE[wc.run],
            launcher=lambda wc: train_launcher(STUDY.run(wc.run).model),
            results=RESULTS,
            study=STUDY.name,
        log:
            train=LOGS / "train" / "{run}.log",
            track=LOGS / "train" / "{run}.track.log",
        threads: rule_threads("train", per_model=True)
        resources:
            **rule_resources("train", per_model=True),
        shell:
            follower()[0] + "        {params.launcher} train --config {params.config:q} --out {params.out} > {log.train} 2>&1\n"
            + follower()[1] + "        touch {output}\n"

else:
    for bundle in WORK.train_bundles:  # pending runs only, in recorded bundles (sweep.study.jobs)
        runs = bundle.pending
        model = STUDY.run(runs[0]).model

        rule:
            name:
                bundle.name
            input:
                model=MODEL_READY[runs[0]],
            output:
                [WORK.done("train", run) for run in runs],
            params:
                runs=shlex.join(arg for run in runs for arg in ("--run", CONFIG_FILE[run], f"{RESULTS}/runs/{run}")),
                follow=f"{RESULTS}/runs/{runs[-1]}",
                launcher=train_launcher(model),
                results=RESULTS,
                study=STUDY.name,
            log:
                train=LOGS / "train" / f"{bundle.name}.log",
                track=LOGS / "train" / f"{bundle.name}.track.log",
            threads: STUDY.resources_for("train", model)["cpus"]
            resources:
                **model_resources("train", model),
            shell:
                follower(" ".join(shlex.quote(f"{RESULTS}/runs/{run}") for run in runs))[0]
                + "        {params.launcher} train-runs {params.runs} > {log.train} 2>&1\n"
                + follower()[1] + "        touch {output}\n"
