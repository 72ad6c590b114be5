# evaluate: every final model on every suite of the study (and, with evaluate.every = N, every
# N-th checkpoint too), through lm-eval with the same verifier as the training rewards. One job per
# pending evaluation, or `bundle.evaluate` pending evaluations of one model and suite per job (one
# `python -m eval run` process with a --model/--out/--seed/--model-record per evaluation: sweep.study.evaluations).
# A finished evaluation (its metrics.json, written last) is in no job; Snakemake sees each evaluation through
# its `.done` file (sweep.study.jobs), which the job writes when it succeeds.


from sweep.study import evaluations

EVAL_ARGS = {run.run_id: evaluations.shared_arguments(STUDY, run.run_id) for run in STUDY.runs}
EVAL_DATA = [STUDY.data_file(name) for name in STUDY.data if name in STUDY.evaluate["data"].values()]
# The evaluations a job may be for: the pending ones in the main process, every one in a job's own
# (a requeued job may find its evaluation finished: sweep.study.jobs).
JOB_EVALS = {target.key: target for target in WORK.evaluations}


def run_of_evaluation(wildcards):
    return JOB_EVALS[wildcards.evaluation].run


def all_evaluations():
    """The `.done` file of every evaluation the study asks for."""
    return [WORK.done("evaluate", target.key) for target in jobs.evaluations(STUDY)]


if STUDY.bundle["evaluate"] == 1:

    rule evaluate:
        """One evaluation, named by its directory under results/eval (<run>/<suite>, <run>/step_<N>/<suite>)."""
        input:
            trained=lambda wc: WORK.done("train", JOB_EVALS[wc.evaluation].run),
            data=EVAL_DATA,
        output:
            WORK.done("evaluate", "{evaluation}"),
        wildcard_constraints:
            evaluation=jobs.only(list(JOB_EVALS)),  # the main process submits no finished evaluation
        params:
            suite=lambda wc: JOB_EVALS[wc.evaluation].suite,
            args=lambda wc: EVAL_ARGS[JOB_EVALS[wc.evaluation].run]
            + evaluations.own_arguments(STUDY, JOB_EVALS[wc.evaluation]),
        log:
            LOGS / "evaluate" / "{evaluation}.log",
        threads: rule_threads("evaluate", per_model=True, run_of=run_of_evaluation)
        resources:
            **rule_resources("evaluate", per_model=True, run_of=run_of_evaluation),
        shell:
            "{PY} -m eval run --suite {params.suite} {params.args:q} > {log} 2>&1 && touch {output}"

else:
    for bundle in WORK.evaluate_bundles:  # pending evaluations only, in recorded bundles (sweep.study.jobs)
        members = [JOB_EVALS[key] for key in bundle.pending]
        first = STUDY.run(members[0].run)

        rule:
            name:
                bundle.name
            input:
                trained=sorted({WORK.done("train", target.run) for target in members}),
                data=EVAL_DATA,
            output:
                [WORK.done("evaluate", target.key) for target in members],
            params:
                each=[arg for target in members for arg in evaluations.own_arguments(STUDY, target)],
                args=EVAL_ARGS[first.run_id],
                suite=members[0].suite,
            log:
                LOGS / "evaluate" / f"{bundle.name}.log",
            threads: STUDY.resources_for("evaluate", first.model)["cpus"]
            resources:
                **model_resources("evaluate", first.model),
            shell:
                "{PY} -m eval run --suite {params.suite} {params.each:q} {params.args:q} > {log} 2>&1 && touch {output}"
