# track and report: MLflow (one parent run per study, a child per grid point; idempotent) and
# paper-style tables and figures from the run directories.


def _uri_args():
    return [f"--uri={STUDY.tracking_uri}"] if STUDY.tracking_uri else []


rule track:
    input:
        runs=[WORK.done("train", run) for run in RUN_IDS],
        evals=all_evaluations(),
    output:
        RESULTS / "tracking" / f"{STUDY.name}.json",
    params:
        uri=_uri_args(),
        results=RESULTS,
    log:
        LOGS / "track.log",
    threads: rule_threads("track")
    resources:
        **rule_resources("track"),
    shell:
        "{PY} -m sweep track --results {params.results} --study {STUDY.name} {params.uri:q} > {output} 2> {log}"


rule report:
    input:
        evals=all_evaluations(),
        audit=rules.audit.output,
        tracked=rules.track.output,
    output:
        RESULTS / "tables" / "results.md",
        RESULTS / "tables" / "results.tex",
        RESULTS / "tables" / "results.csv",
    params:
        uri=_uri_args(),
        results=RESULTS,
    log:
        LOGS / "report.log",
    threads: rule_threads("report")
    resources:
        **rule_resources("report"),
    shell:
        "{PY} -m sweep report --results {params.results} --study {STUDY.name} {params.uri:q} > {log} 2>&1"
