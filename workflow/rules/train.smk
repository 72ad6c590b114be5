# train: one job per grid point. The run directory is the state: the trainer resumes from its
# newest valid checkpoint and leaves a finished run alone, and COMPLETE (the job's only output)
# appears last, so an interrupted job never looks finished. With MLFLOW_TRACKING_URI set, a
# follower streams the run's metrics to that server while it trains. A job with several GPUs runs
# the trainer under `accelerate launch`, one process per GPU (trainer.launch).


MODEL_READY = {run.run_id: STUDY.model_ready(run.model) for run in STUDY.runs}
OVERRIDES = {run.run_id: run.overrides() for run in STUDY.runs}


def train_launcher(wildcards):
    """The command that starts the trainer: one process, or one per GPU of the job."""
    gpus = STUDY.resources_for("train", STUDY.run(wildcards.run).model).get("gpus") or 0
    return shlex.join(train_command(PY, int(gpus)))


rule train:
    input:
        model=lambda wc: MODEL_READY[wc.run],
    output:
        RESULTS / "runs" / "{run}" / "COMPLETE",
    params:
        out=f"{RESULTS}/runs/{{run}}",  # a string: Snakemake fills wildcards into strings only
        overrides=lambda wc: OVERRIDES[wc.run],
        launcher=train_launcher,
        results=RESULTS,
        study=STUDY.name,
    log:
        train=LOGS / "train" / "{run}.log",
        track=LOGS / "train" / "{run}.track.log",
    threads: rule_threads("train", per_model=True)
    resources:
        **rule_resources("train", per_model=True),
    shell:
        """
        if [ -n "${{MLFLOW_TRACKING_URI:-}}" ]; then
            {PY} -m sweep track --results {params.results} --study {params.study} --follow {params.out} \
                > {log.track} 2>&1 &
            trap "kill $! 2>/dev/null || true" EXIT
        fi
        {params.launcher} train --out {params.out} {params.overrides:q} > {log.train} 2>&1
        """
