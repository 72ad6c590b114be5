"""What the work left will cost, said in the dry run's plan (sweep.study.plan): GPU-hours per group of jobs and
for the study, and whether a job told to stop before its time limit has the time to save its run.

A training run's cost is its steps left x the seconds of one step x the GPUs of its job (GPUs per node x
nodes). The seconds of one step come, in this order, from:
- the study's own runs of that model: the median `step_time` their metrics.jsonl files logged (measured,
  on the study's own machines; at most `SAMPLED_RUNS` runs per model are read);
- the study config's estimate, `budget.step_seconds` (one number, or one per model);
- else nothing, and the plan says the cost is unknown.
The other jobs have no per-step cost: their GPU-hours are at most their GPUs x their time limit
(`runtime`), the most SLURM can hold for them.

Before its time limit a job is told to stop (submitit's `signal_delay`: profiles/slurm sets 120 s); the
executor gives the training command `signal_delay - 20` s of it. In that time the trainer finishes its
current step, then one process writes what the train state holds (trainer.checkpoint_copies): the
weights and AdamW's two moments, and the reference where it moves (`objective.ref_refresh_every`):
three or four copies of the weights in the run's `model.dtype`. Their size comes from the model's
safetensors headers: its local directory, the prepared model or the hub cache, else (where this node
is online) the headers the hub serves, a few kilobytes per file; the write speed is
`budget.write_mb_per_s` (a stated 500 MB/s unless the study gives its file system's).
"""

from __future__ import annotations

import json
import math
import statistics
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from sweep.study.executor_settings import executor_setting
from sweep.study.grid import Study
from trainer.checkpoint_copies import weight_copies
from trainer.config import ModelConfig, TrainConfig

SAMPLED_RUNS = 16        # runs per model whose logged step times price the rest
EXECUTOR_MARGIN_S = 20   # snakemake_executor_plugin_submitit: the command gets signal_delay - 20 s (at least 10)
DEFAULT_SIGNAL_DELAY_S = 90  # the executor's own default, where neither the command line nor a profile sets it
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 4}  # auto: the checkpoint's own dtype, float32 at most
SLURM_EARLY_S = 60       # SLURM checks every 30 s and may send the warning up to 60 s before signal_delay


@dataclass(frozen=True)
class StepCost:
    """Seconds per training step of one model, and where the number comes from (None: unknown)."""

    seconds: float | None
    source: str


def step_cost(study: Study, model: str) -> StepCost:
    """The model's seconds per step: measured on the study's own runs, else the study's estimate."""
    measured = _logged_step_times(study, model)
    if measured:
        runs, times = measured
        return StepCost(statistics.median(times), f"measured: median of {len(times)} steps of {runs} "
                                                  f"run{'s' * (runs != 1)} of this study")
    estimate = study.budget.get("step_seconds")
    if isinstance(estimate, dict):
        estimate = estimate.get(model)
    if estimate is not None:
        return StepCost(float(estimate), "estimate: budget.step_seconds")
    return StepCost(None, "no run of this model has logged a step yet: set budget.step_seconds to price it")


def _logged_step_times(study: Study, model: str) -> tuple[int, list[float]] | None:
    runs, times = 0, []
    for run in study.runs:
        if run.model != model or runs == SAMPLED_RUNS:
            continue
        metrics = study.results / "runs" / run.run_id / "metrics.jsonl"
        if not metrics.is_file():
            continue
        logged = [record["step_time"] for record in map(_record, metrics.read_text().splitlines())
                  if isinstance(record.get("step_time"), (int, float))]
        if logged:
            runs, times = runs + 1, times + logged
    return (runs, times) if times else None


def _record(line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:  # a line cut by a kill
        return {}
    return record if isinstance(record, dict) else {}


def job_gpus(resources: Mapping[str, Any]) -> int:
    """GPUs a job holds: `gpus` is per node."""
    return int(resources.get("gpus") or 0) * int(resources.get("nodes") or 1)


def hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}" if value else "0"


def train_lines(study: Study, steps_left: Mapping[str, int]) -> tuple[list[str], float, list[str]]:
    """Per model with runs left: the plan's line, the GPU-hours it adds, and the models left unpriced.
    `steps_left`: run id -> steps its run has still to take (the pending runs only)."""
    lines, total, unknown = [], 0.0, []
    for model in study.models:
        runs = [run for run in steps_left if study.run(run).model == model]
        if not runs:
            continue
        steps, gpus = sum(steps_left[run] for run in runs), job_gpus(study.resources_for("train", model))
        cost = step_cost(study, model)
        work = f"train, {model}: {len(runs)} run{'s' * (len(runs) != 1)}, {steps:,} steps left"
        if cost.seconds is None:
            lines.append(f"    {work}: unknown ({cost.source})")
            unknown.append(model)
            continue
        job_hours = steps * cost.seconds / 3600
        total += job_hours * gpus
        lines.append(f"    {work} x {cost.seconds:.3g} s ({cost.source}): {hours(job_hours)} job-hours x {gpus} "
                     f"GPU{'s' * (gpus != 1)}: {hours(job_hours * gpus)} GPU-hours")
    return lines, total, unknown


def other_lines(groups: list[tuple[str, int, dict[str, Any]]]) -> tuple[list[str], float]:
    """The jobs without a step cost, bounded by their time limits: their lines and GPU-hours at most."""
    lines, bound = [], 0.0
    for what, jobs, resources in groups:
        if what.startswith("train"):
            continue
        gpus = job_gpus(resources)
        if not gpus:
            continue
        most = jobs * gpus * resources.get("runtime", 0) / 60
        bound += most
        lines.append(f"    {what}: {jobs} job{'s' * (jobs != 1)} x {gpus} GPU{'s' * (gpus != 1)} x at most "
                     f"{resources.get('runtime')} min: at most {hours(most)} GPU-hours")
    return lines, bound


def budget_lines(study: Study, groups: list[tuple[str, int, dict[str, Any]]], steps_left: Mapping[str, int],
                 signal_delay: tuple[int, str]) -> list[str]:
    """The plan's budget: GPU-hours of the work left, then whether a stopped job can save its run."""
    train, expected, unknown = train_lines(study, steps_left)
    others, bound = other_lines(groups)
    if unknown and not expected:
        total = f"training unknown (no step cost for {', '.join(unknown)})"
    else:
        total = f"{hours(expected)} GPU-hours for training"
        total += f", and unknown for {', '.join(unknown)}" if unknown else ""
    if bound:
        total += f"; at most {hours(bound)} GPU-hours for the other jobs"
    lines = ["  budget (the work left; a job's GPUs x its hours):", *train, *others, f"    study: {total}"]
    return lines + checkpoint_lines(study, steps_left, signal_delay)


def checkpoint_lines(study: Study, steps_left: Mapping[str, int], signal_delay: tuple[int, str]) -> list[str]:
    """Whether signal_delay leaves time for a step and the checkpoint, per model with runs left."""
    delay, source = signal_delay
    grace = max(10, delay - EXECUTOR_MARGIN_S)
    speed = study.budget["write_mb_per_s"]
    lines = [f"  saving on a stop: signal_delay {delay} s ({source}) gives a training job {grace} s to finish its "
             f"step and write its checkpoint, at {speed:g} MB/s (budget.write_mb_per_s):"]
    for model in study.models:
        runs = [run for run in steps_left if study.run(run).model == model]
        if not runs:
            continue
        lines += _runtime_lines(model, study.resources_for("train", model).get("runtime"), delay)
        params = parameter_count(study, model)
        if params is None:
            why = ("the prepare step has not built it yet" if study.models[model].prepared
                   else "its weights are neither on this node nor readable from the hub from here")
            lines.append(f"    {model}: size unknown ({why})")
            continue
        for (dtype, copies), alike in _checkpoints(study, runs).items():
            some = alike if len(alike) < len(runs) else []
            lines.append(_checkpoint_line(model, params, dtype, copies, some, step_cost(study, model).seconds,
                                          speed, grace))
    return lines


def _checkpoints(study: Study, runs: list[str]) -> dict[tuple[str, tuple[tuple[str, int], ...]], list[str]]:
    """The runs grouped by what their checkpoints hold: (dtype, the copies of the weights) -> run ids."""
    groups: dict[tuple[str, tuple[tuple[str, int], ...]], list[str]] = {}
    for run in runs:
        config = study.run(run).config
        key = (config.get("model", {}).get("dtype", ModelConfig.dtype), tuple(weight_copies(config).items()))
        groups.setdefault(key, []).append(run)
    return groups


def _checkpoint_line(model: str, params: int, dtype: str, copies: tuple[tuple[str, int], ...], some: list[str],
                     step_s: float | None, speed: float, grace: int) -> str:
    """One group's line (`some`: its runs, where the model's others save another checkpoint): the checkpoint's
    size, its write time, and whether the grace covers it and a step."""
    count = sum(number for _, number in copies)
    size_mb = params * BYTES.get(dtype, 4) * count / 1e6
    write_s = size_mb / speed
    which = f" ({len(some)} of its runs, such as {some[0]})" if some else ""
    said = (f"    {model}{which}: {_count(params)} parameters x {count} ({', '.join(name for name, _ in copies)}) x "
            f"{dtype} = {_size(size_mb)}, written in {_seconds(write_s)} s")
    if step_s is None:
        said, need = f"{said} after a step of unknown time", write_s
    else:
        said, need = f"{said} after a step of {step_s:.3g} s", write_s + step_s
    if need <= grace:
        return f"{said}: enough" + (" for the write" if step_s is None else "")
    return (f"{said}: NOT enough: set the executor's signal delay to at least {math.ceil(need) + EXECUTOR_MARGIN_S} "
            "s (`submitit-signal-delay` in the profile), or the job is killed mid-write and resumes from its "
            "previous checkpoint")


def _runtime_lines(model: str, runtime: Any, delay: int) -> list[str]:
    """A training job whose time limit is within the warning's reach from its start is told to stop at
    SLURM's first check, every attempt: it saves and requeues before it has trained much, until
    `submitit-max-timeouts` runs out."""
    if not isinstance(runtime, (int, float)) or runtime * 60 > delay + SLURM_EARLY_S:
        return []
    return [f"    {model}: NOT enough: a training job's runtime of {runtime:g} min is within signal_delay + "
            f"{SLURM_EARLY_S} s of its start, so SLURM may tell it to stop at its first check, every attempt; "
            f"give train a runtime of more than {math.ceil((delay + SLURM_EARLY_S) / 60)} min, with its steps "
            "on top, or lower the signal delay"]


def _count(params: int) -> str:
    return f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M" if params >= 1e6 else f"{params:,}"


def _seconds(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _size(mb: float) -> str:
    return f"{mb / 1e3:,.1f} GB" if mb >= 1e3 else f"{mb:,.1f} MB"


def parameter_count(study: Study, model: str) -> int | None:
    """The model's parameter count from its safetensors headers: its files on this node, else (a hub model,
    where this node is online) the headers the hub serves; None where neither can be read."""
    directory = model_files(study, model)
    files = sorted(directory.glob("*.safetensors")) if directory is not None else []
    if files:
        return sum(_tensor_elements(path) for path in files)
    spec = study.models[model]
    return None if spec.prepared or Path(spec.path).expanduser().is_dir() else hub_parameter_count(spec.path)


def hub_parameter_count(hub_id: str) -> int | None:
    """The hub's count from the safetensors headers alone (a range request per file), or None: offline, no
    such model, gated without a token here, no safetensors."""
    from huggingface_hub import constants, get_safetensors_metadata

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        metadata = get_safetensors_metadata(hub_id, timeout=10)
    except Exception:  # network, gated, missing: the plan then says the size is unknown
        return None
    return sum(metadata.parameter_count.values()) or None


def model_files(study: Study, model: str) -> Path | None:
    """Where the model's weights are on this node: the prepared model, a local directory, or the hub cache."""
    spec = study.models[model]
    if spec.prepared:
        directory = study.model_dir(model)
        return directory if directory.is_dir() else None
    local = Path(spec.path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(spec.path, "config.json")
    return Path(config).parent if isinstance(config, str) else None


def _tensor_elements(path: Path) -> int:
    """The elements of every tensor in a safetensors file, from its header alone (8 bytes of length, JSON)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def signal_delay(argv: list[str], environ: Mapping[str, str]) -> tuple[int, str]:
    """The executor's signal delay and where it comes from (sweep.study.executor_settings), else its default."""
    found = executor_setting("signal-delay", argv, environ)
    return (int(found[0]), found[1]) if found else (DEFAULT_SIGNAL_DELAY_S, "the executor's default")


def steps_of(config: Mapping[str, Any]) -> int:
    return config.get("train", {}).get("steps", TrainConfig.steps)
