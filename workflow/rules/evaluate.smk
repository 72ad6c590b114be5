# evaluate: every final model on every suite of the study (and, with evaluate.every = N, every
# N-th checkpoint too), through lm-eval with the same verifier as the training rewards. One job per
# evaluation, or `bundle.evaluate` evaluations of one suite per job (one `python -m eval run`
# process with a --model/--out/--seed per evaluation).


def _eval_args(run):
    """The `python -m eval run` options of a run's evaluations (final model and checkpoints alike),
    except --seed (the run's own)."""
    spec, model = STUDY.evaluate, run.config.get("model", {})
    args = [f"--samples={spec['samples']}", f"--batch-size={spec['batch_size']}",
            f"--temperature={spec['temperature']}", f"--top-p={spec['top_p']}", f"--backend={spec['backend']}",
            f"--dtype={model.get('dtype', 'float32')}", f"--device={model.get('device', 'cpu')}"]
    args += [f"--{name.replace('_', '-')}={spec[name]}" for name in ("limit", "max_gen_toks") if spec[name] is not None]
    args += [f"--data={task}={source}" for task, source in STUDY.eval_data().items()]
    return args + (["--chat-template"] if model.get("chat_template") else [])


EVAL_ARGS = {run.run_id: _eval_args(run) for run in STUDY.runs}
EVAL_DATA = [STUDY.data_file(name) for name in STUDY.data if name in STUDY.evaluate["data"].values()]


def evaluated(run, step, suite):
    """Where an evaluation goes: results/eval/<run>/<suite> (final model) or .../step_<N>/<suite>."""
    return RESULTS / "eval" / run / ("" if step is None else f"step_{step}") / suite


def evaluated_model(run, step):
    return RESULTS / "runs" / run / ("final" if step is None else f"checkpoints/step_{step}/model")


# every evaluation the study asks for, run by run (so that a bundle waits for few training jobs):
# (run, step), with step None for the final model
EVALUATIONS = [(run, step) for run in RUN_IDS for step in [*STUDY.eval_steps(run), None]]


def all_evaluations():
    """Every metrics.json the study asks for."""
    return [evaluated(run, step, suite) / "metrics.json" for run, step in EVALUATIONS
            for suite in STUDY.evaluate["suites"]]


if STUDY.bundle["evaluate"] == 1:

    rule evaluate:
        input:
            complete=RESULTS / "runs" / "{run}" / "COMPLETE",
            data=EVAL_DATA,
        output:
            RESULTS / "eval" / "{run}" / "{suite}" / "metrics.json",
        params:
            model=f"{RESULTS}/runs/{{run}}/final",  # strings: Snakemake fills wildcards into strings only
            out=f"{RESULTS}/eval/{{run}}/{{suite}}",
            args=lambda wc: EVAL_ARGS[wc.run] + [f"--seed={STUDY.run(wc.run).seed}"],
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
            args=lambda wc: EVAL_ARGS[wc.run] + [f"--seed={STUDY.run(wc.run).seed}"],
        log:
            LOGS / "evaluate" / "{run}" / "step_{step}-{suite}.log",

else:
    for suite in STUDY.evaluate["suites"]:
        for number, members in enumerate(STUDY.bundles("evaluate", EVALUATIONS, model_of=lambda e: e[0])):
            first = STUDY.run(members[0][0])

            rule:
                name:
                    f"evaluate_{suite}_{number}"
                input:
                    complete=sorted({RESULTS / "runs" / run / "COMPLETE" for run, _ in members}),
                    data=EVAL_DATA,
                output:
                    [evaluated(run, step, suite) / "metrics.json" for run, step in members],
                params:
                    each=[f"--{flag}={value}" for run, step in members for flag, value in (
                        ("model", evaluated_model(run, step)), ("out", evaluated(run, step, suite)),
                        ("seed", STUDY.run(run).seed))],
                    args=EVAL_ARGS[first.run_id],
                    suite=suite,
                log:
                    LOGS / "evaluate" / f"{suite}_job_{number}.log",
                threads: STUDY.resources_for("evaluate", first.model)["cpus"]
                resources:
                    **model_resources("evaluate", first.model),
                shell:
                    "{PY} -m eval run --suite {params.suite} {params.each:q} {params.args:q} > {log} 2>&1"
