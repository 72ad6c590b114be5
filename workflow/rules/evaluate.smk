# evaluate: every final model on every suite of the study (and, with evaluate.every = N, every
# N-th checkpoint too), through lm-eval with the same verifier as the training rewards.


def _eval_args(run):
    """The `python -m eval run` options of a run's evaluations (final model and checkpoints alike)."""
    spec, model = STUDY.evaluate, run.config.get("model", {})
    args = [f"--samples={spec['samples']}", f"--batch-size={spec['batch_size']}",
            f"--temperature={spec['temperature']}", f"--top-p={spec['top_p']}", f"--backend={spec['backend']}",
            f"--seed={run.seed}", f"--dtype={model.get('dtype', 'float32')}", f"--device={model.get('device', 'cpu')}"]
    args += [f"--{name.replace('_', '-')}={spec[name]}" for name in ("limit", "max_gen_toks") if spec[name] is not None]
    args += [f"--data={task}={source}" for task, source in STUDY.eval_data().items()]
    return args + (["--chat-template"] if model.get("chat_template") else [])


EVAL_ARGS = {run.run_id: _eval_args(run) for run in STUDY.runs}
EVAL_DATA = [STUDY.data_file(name) for name in STUDY.data if name in STUDY.evaluate["data"].values()]


rule evaluate:
    input:
        complete=RESULTS / "runs" / "{run}" / "COMPLETE",
        data=EVAL_DATA,
    output:
        RESULTS / "eval" / "{run}" / "{suite}" / "metrics.json",
    params:
        model=f"{RESULTS}/runs/{{run}}/final",  # strings: Snakemake fills wildcards into strings only
        out=f"{RESULTS}/eval/{{run}}/{{suite}}",
        args=lambda wc: EVAL_ARGS[wc.run],
    log:
        LOGS / "evaluate" / "{run}" / "{suite}.log",
    threads: rule_threads("evaluate", per_model=True)
    resources:
        **rule_resources("evaluate", per_model=True),
    shell:
        "{PY} -m eval run --model {params.model} --suite {wildcards.suite} --out {params.out} {params.args:q}"
        " > {log} 2>&1"


use rule evaluate as evaluate_checkpoint with:
    output:
        RESULTS / "eval" / "{run}" / "step_{step}" / "{suite}" / "metrics.json",
    params:
        model=f"{RESULTS}/runs/{{run}}/checkpoints/step_{{step}}/model",
        out=f"{RESULTS}/eval/{{run}}/step_{{step}}/{{suite}}",
        args=lambda wc: EVAL_ARGS[wc.run],
    log:
        LOGS / "evaluate" / "{run}" / "step_{step}-{suite}.log",


def all_evaluations():
    """Every metrics.json the study asks for: final models, then the kept checkpoints."""
    suites = STUDY.evaluate["suites"]
    files = [RESULTS / "eval" / run / suite / "metrics.json" for run in RUN_IDS for suite in suites]
    files += [RESULTS / "eval" / run / f"step_{step}" / suite / "metrics.json"
              for run in RUN_IDS for step in STUDY.eval_steps(run) for suite in suites]
    return files
