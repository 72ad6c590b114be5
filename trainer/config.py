"""The typed run configuration: YAML in, frozen dataclasses out, every error naming its key.

A run config has sections model, task, objective, rollout, train, checkpoint, verifier and
measure. Every key can be overridden on the command line as section.key=value (read as YAML).
Validation happens here, before any model loads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.choices import ENGINES, HF_DECODINGS, LR_SCHEDULES, MIXED_PRECISIONS, TASK_NAMES
from trainer.config_error import ConfigError
from trainer.objective import advantages, presets
from trainer.objective.objective_config import ObjectiveConfig


def bounded(default: Any, bound: str) -> Any:
    """A field whose values must lie in `bound` (a key of BOUNDS), declared beside it: `validate` checks it,
    and the reference page shows it."""
    return field(default=default, metadata={"bound": bound})


def chosen(default: str, choices: tuple[str, ...]) -> Any:
    """A field whose value must be one of `choices`, declared beside it (checked by `validate`)."""
    return field(default=default, metadata={"choices": choices})


BOUNDS = {">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0,
          "in (0, 1]": lambda v: 0 < v <= 1, "in [0, 1]": lambda v: 0 <= v <= 1}  # NaN fails every one


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""                  # local directory or hub id
    name: str = ""                  # what studies and reports call it (default: the path's last part)
    dtype: str = "float32"          # float32 | bfloat16 | float16 | auto
    device: str = "cpu"             # cpu | cuda | cuda:N | auto
    chat_template: bool = False     # format prompts with the tokenizer's chat template


@dataclass(frozen=True)
class TaskConfig:
    name: str = chosen("arithmetic", TASK_NAMES)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = chosen("hf", ENGINES)
    temperature: float = bounded(1.0, "> 0")
    top_p: float = bounded(1.0, "in (0, 1]")
    max_new_tokens: int = bounded(16, ">= 1")
    stop: tuple[str, ...] = ()
    recompute_logprobs: bool = False  # behaviour log-probs from the trainer instead of the engine (the paper-*
                                      # presets' default: trainer.objective.presets, run_defaults)
    hf_decoding: str = chosen("auto", HF_DECODINGS)  # hf only: auto is compiled on CUDA (trainer.rollout.decoding)
    # vllm only (trainer.rollout.vllm): a colocated engine per training process
    vllm_gpu_memory_utilization: float = bounded(0.3, "in (0, 1]")  # share of each GPU for weights and KV cache
    vllm_tensor_parallel_size: int = bounded(1, ">= 1")  # GPUs (training processes) one engine spans
    vllm_sleep: bool = True         # release vLLM's GPU memory while the trainer trains (CUDA only: off on CPU)
    vllm_max_model_len: int = bounded(0, ">= 0")  # prompt + completion tokens vLLM plans for (0: the model's maximum)
    vllm_cpu_kvcache_gib: int = bounded(1, ">= 1")  # CPU build: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB)


@dataclass(frozen=True)
class StopIf:
    """Ends a run as failed, with its reason, once its importance weights have degenerated (trainer.run.stop_rule)."""

    ess_below: float = bounded(0.0, "in [0, 1]")  # the step's `ess` under this (0: no rule) ...
    for_steps: int = bounded(1, ">= 1")  # ... in this many steps in a row


@dataclass(frozen=True)
class TrainConfig:
    steps: int = bounded(20, ">= 1")
    prompts_per_step: int = bounded(8, ">= 1")
    group_size: int = bounded(4, ">= 1")
    lr: float = bounded(1e-4, "> 0")
    lr_schedule: str = chosen("constant", LR_SCHEDULES)  # after warm-up (linear and cosine: to zero at the end)
    warmup_steps: int = bounded(0, ">= 0")
    weight_decay: float = bounded(0.0, ">= 0")
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = bounded(1.0, ">= 0")  # max gradient norm; 0 = no clipping
    minibatches: int = bounded(1, ">= 1")  # optimizer updates per epoch over a batch (whole groups each)
    epochs: int = bounded(1, ">= 1")  # passes over each batch
    async_level: int = bounded(0, ">= 0")  # train step s on rollouts of the policy of step s - async_level
    seed: int = 0
    max_nonfinite_updates: int = bounded(3, ">= 1")  # stop after this many skipped (NaN/inf) updates in a row
    logprob_chunk: int = bounded(1024, ">= 0")  # tokens whose logits exist at once in log-prob passes (0: all, naive)
    micro_batch_size: int = bounded(0, ">= 0")  # completions per forward/backward, accumulated (0: a whole minibatch)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass
    mixed_precision: str = chosen("no", MIXED_PRECISIONS)  # bf16: compute in bfloat16 over float32 weights
    stop_if: StopIf = field(default_factory=StopIf)  # end the run as failed when `ess` stays low


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = bounded(10, ">= 1")  # steps between checkpoints
    keep: int = bounded(2, ">= 1")  # newest checkpoints kept
    keep_every: int = bounded(0, ">= 0")  # also keep every checkpoint at a multiple of this step (0: none)


@dataclass(frozen=True)
class VerifierConfig:
    timeout: float = bounded(5.0, "> 0")  # seconds per math-verify call
    workers: int = bounded(2, ">= 1")


@dataclass(frozen=True)
class MeasureConfig:
    """The regularized objective measured on held-out prompts (trainer.measure.objective)."""

    prompts: int = bounded(0, ">= 0")  # held-out prompts (0: no measurement)
    samples: int = 16               # the policy's completions per prompt at each measurement (>= 1 with prompts)
    reference_samples: int = 64     # the reference's completions per prompt, once: their rewards give J* (>= 1 too)
    every: int = bounded(0, ">= 0")  # also measure every N steps (0: the final model only)
    seed: int = 1                   # picks the prompts and seeds their sampling (the same at every measurement)
    task_options: dict[str, Any] = field(default_factory=dict)  # task.options overrides for the held-out set


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """`value` as `annotation` (the few types configs use), or a ConfigError naming `key`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if dataclasses.is_dataclass(annotation):  # a section within a section (train.stop_if)
        return _section(annotation, value, key)
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, str) and args and args[-1] is Ellipsis:
            value = [value]
        if isinstance(value, (list, tuple)):
            if args and args[-1] is Ellipsis:
                return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
            if len(value) == len(args):
                return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    name = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(key, f"expected {name}, got {value!r}")


def _reject_unknown(cls: type, data: dict[str, Any], section: str | None) -> None:
    """A ConfigError naming the first key of `data` that `cls` has no field for."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        key, what = (f"{section}.{unknown[0]}", "key") if section else (unknown[0], "section")
        raise ConfigError(key, f"unknown {what} (known: {', '.join(known)})")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config class's resolved annotations, resolved once: resolving them was most of a config's validation
    (`python -m sweep status` compares each of a paper-sized study's 333 runs with its saved config:
    benchmarks/sweep_status.py, median 1.41 s uncached, 0.67 s cached)."""
    return typing.get_type_hints(cls)


def _section(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping, got {data!r}")
    hints = _hints(cls)
    _reject_unknown(cls, data, prefix)
    if cls is ObjectiveConfig:  # the preset's values under the keys given
        data = presets.expand(data)
    values = {k: _coerce(f"{prefix}.{k}", v, hints[k]) for k, v in data.items()}
    return cls(**values)  # ObjectiveConfig raises its own ConfigError, with its key


def from_dict(data: dict[str, Any]) -> RunConfig:
    """A validated RunConfig from nested plain data."""
    if not isinstance(data, dict):
        raise ConfigError("config", f"expected a mapping of sections, got {type(data).__name__}")
    hints = _hints(RunConfig)
    _reject_unknown(RunConfig, data, None)
    data = presets.run_defaults(data)  # the rollout keys an objective preset decides, where not given
    names = [f.name for f in dataclasses.fields(RunConfig)]
    config = RunConfig(**{name: _section(hints[name], data.get(name), name) for name in names})
    validate(config)
    return config


def _check_declared(key: str, value: Any, spec: dataclasses.Field) -> None:
    """The bound or the choices declared beside a field (`bounded`, `chosen`)."""
    bound, choices = spec.metadata.get("bound"), spec.metadata.get("choices")
    if bound is not None and not BOUNDS[bound](value):
        raise ConfigError(key, f"must be {bound}, got {value}")
    if choices is not None and value not in choices:
        raise ConfigError(key, f"{value!r} is not one of {', '.join(choices)}")


def _check_section(prefix: str, values: Any) -> None:
    """The declared bounds and choices of a section's fields, and of the sections within it."""
    for spec in dataclasses.fields(values):
        value = getattr(values, spec.name)
        if dataclasses.is_dataclass(value):
            _check_section(f"{prefix}.{spec.name}", value)
        else:
            _check_declared(f"{prefix}.{spec.name}", value, spec)


def validate(config: RunConfig) -> None:
    """The bounds and choices declared beside the fields, then the checks across fields, that need no model
    or data (the objective's section checked itself when it was made)."""
    t, r = config.train, config.rollout
    if not config.model.path:
        raise ConfigError("model.path", "required (a local model directory or a hub id)")
    for section in dataclasses.fields(RunConfig):
        _check_section(section.name, getattr(config, section.name))
    m = config.measure
    for key in ("samples", "reference_samples"):
        if m.prompts and getattr(m, key) < 1:
            raise ConfigError(f"measure.{key}", f"must be >= 1 where measure.prompts is set, got {getattr(m, key)}")
    try:
        advantages.check_group_size(config.objective.advantage, t.group_size, grpo_scale=config.objective.grpo_scale)
    except ValueError as error:
        raise ConfigError("train.group_size", str(error)) from None
    if config.objective.needs_full_kl and t.logprob_chunk == 0:
        raise ConfigError("train.logprob_chunk", f"estimator {config.objective.estimator} computes the KL over the "
                          "vocabulary a chunk of tokens at a time; set a chunk > 0 (0 would build [B, T, V] logits)")
    if config.objective.entropy_coef and t.logprob_chunk == 0:
        raise ConfigError("train.logprob_chunk", "objective.entropy_coef computes the exact entropy a chunk of tokens "
                          "at a time; set a chunk > 0 (0 would build [B, T, V] logits)")
    if t.prompts_per_step % t.minibatches:
        raise ConfigError("train.minibatches", f"{t.minibatches} does not divide prompts_per_step "
                          f"{t.prompts_per_step} (minibatches hold whole groups)")
    if t.micro_batch_size % t.group_size:
        raise ConfigError("train.micro_batch_size", f"{t.micro_batch_size} is not a multiple of group_size "
                          f"{t.group_size} (micro-batches hold whole groups)")
    if r.top_p < 1:
        raise ConfigError("rollout.top_p", f"{r.top_p} < 1 samples from the nucleus of each next-token distribution, "
                          "not from the policy, and no importance weight brings back the tokens it never draws: every "
                          "gradient would be biased (docs/top_p.md); train with top_p 1.0 (evaluate.top_p is separate)")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` strings applied to nested data; values are parsed as YAML."""
    data = _plain(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}", "expected section.key=value")
        value = yaml.safe_load(raw) if raw else ""
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}", f"{part} is not a section")
        node[parts[-1]] = value
    return data


def load(path: Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config (or start from the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError("--config", f"no such file {path}") from None
        except yaml.YAMLError as error:
            raise ConfigError("--config", f"{path} is not valid YAML ({error})") from None
    return from_dict(apply_overrides(data, list(overrides)))


def as_saved(saved: Any) -> Any:
    """A run directory's config.yaml as it compares with a config now: with the keys added to klstudy
    since it was written, at their defaults (such a run still resumes); as saved if it no longer
    validates (then it differs anyway)."""
    try:
        return from_dict(saved).to_dict()
    except ConfigError:
        return saved


def digest(config: RunConfig) -> str:
    """The run's identity: the sha256 of what its config sets apart from the trainer's defaults, as canonical
    JSON. Two configs that train the same run share it however they were written (a default given or left
    out, 1 for 1.0), and a key klstudy adds later, at its default, leaves every digest as it was."""
    defaults = _default_dict()
    own = {name: {key: value for key, value in values.items() if defaults[name][key] != value}
           for name, values in config.to_dict().items()}
    text = json.dumps({name: values for name, values in own.items() if values}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _default_dict() -> dict[str, Any]:
    return RunConfig().to_dict()


def differences(wanted: dict[str, Any], saved: Any) -> list[str]:
    """The `section.key`s where a saved config (as_saved) differs from the wanted one, sorted."""
    saved = saved if isinstance(saved, dict) else {}
    section = lambda data, name: data.get(name) if isinstance(data.get(name), dict) else {}  # noqa: E731
    return sorted(f"{name}.{key}" for name in set(wanted) | set(saved)
                  for key in set(section(wanted, name)) | set(section(saved, name))
                  if section(wanted, name).get(key) != section(saved, name).get(key))
