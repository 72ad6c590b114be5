# train: one job per grid point, or `bundle.train` grid points per job (trained one after another in
# one process: `python -m trainer train-runs`). The run directory is the state: the trainer resumes
# from its newest valid checkpoint and leaves a finished run alone, and COMPLETE (the job's output)
# appears last, so an interrupted job never looks finished. With MLFLOW_TRACKING_URI set, a follower
# streams the runs' metrics to that server while they train. A job with several GPUs runs the
# trainer under `accelerate launch`, one process per GPU (trainer.launch).


MODEL_READY = {run.run_id: STUDY.model_ready(run.model) for run in STUDY.runs}
OVERRIDES = {run.run_id: run.overrides() for run in STUDY.runs}
TRAIN_JOBS = STUDY.bundles("train", RUN_IDS)


def train_launcher(model):
    """The command that starts the trainer for `model`'s runs: one process, or one per GPU of the job."""
    gpus = STUDY.resources_for("train", model).get("gpus") or 0
    return shlex.join(train_command(PY, int(gpus)))


# The follower syncs the whole study each round, until the job's last run is complete.
FOLLOW = """
        if [ -n "${{MLFLOW_TRACKING_URI:-}}" ]; then
            {PY} -m sweep track --results {params.results} --study {params.study} --follow {params.follow} \\
                > {log.track} 2>&1 &
            trap "kill $! 2>/dev/null || true" EXIT
        fi
"""


if STUDY.bundle["train"] == 1:

    rule train:
        input:
            model=lambda wc: MODEL_READY[wc.run],
        output:
            RESULTS / "runs" / "{run}" / "COMPLETE",
        params:
            out=f"{RESULTS}/runs/{{run}}",  # a string: Snakemake fills wildcards into strings only
            follow=f"{RESULTS}/runs/{{run}}",
            overrides=lambda wc: OVERRIDES[wc.run],
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
            FOLLOW + "        {params.launcher} train --out {params.out} {params.overrides:q} > {log.train} 2>&1\n"

else:
    for number, runs in enumerate(TRAIN_JOBS):
        model = STUDY.run(runs[0]).model

        rule:
            name:
                f"train_{number}"
            input:
                model=MODEL_READY[runs[0]],
            output:
                [RESULTS / "runs" / run / "COMPLETE" for run in runs],
            params:
                plan=json.dumps({f"{RESULTS}/runs/{run}": OVERRIDES[run] for run in runs}),
                follow=f"{RESULTS}/runs/{runs[-1]}",
                launcher=train_launcher(model),
                results=RESULTS,
                study=STUDY.name,
            log:
                train=LOGS / "train" / f"job_{number}.log",
                track=LOGS / "train" / f"job_{number}.track.log",
            threads: STUDY.resources_for("train", model)["cpus"]
            resources:
                **model_resources("train", model),
            shell:
                FOLLOW + "        {params.launcher} train-runs --plan {params.plan:q} > {log.train} 2>&1\n"
