"""The typed run configuration: YAML in, frozen dataclasses out, every error naming its key.

A run config has sections model, task, objective, rollout, train, checkpoint, verifier and
measure. Every key can be overridden on the command line as section.key=value (read as YAML).
Validation happens here, before any model loads.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.choices import ENGINES, HF_DECODINGS, LR_SCHEDULES, MIXED_PRECISIONS, TASK_NAMES
from trainer.objective import advantages, presets
from trainer.objective.objective_config import ObjectiveConfig


class ConfigError(ValueError):
    """A bad run config; the message starts with the offending key."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""                  # local directory or hub id
    name: str = ""                  # what studies and reports call it (default: the path's last part)
    dtype: str = "float32"          # float32 | bfloat16 | float16 | auto
    device: str = "cpu"             # cpu | cuda | cuda:N | auto
    chat_template: bool = False     # format prompts with the tokenizer's chat template


@dataclass(frozen=True)
class TaskConfig:
    name: str = "arithmetic"        # arithmetic | countdown | math
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "hf"              # hf | vllm
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()
    recompute_logprobs: bool = False  # behaviour log-probs from the trainer instead of the engine (the paper-*
                                      # presets' default: trainer.objective.presets, run_defaults)
    hf_decoding: str = "auto"       # hf only: auto (compiled on CUDA) | eager | compiled (trainer.rollout.decoding)
    # vllm only (trainer.rollout.vllm): a colocated engine per training process
    vllm_gpu_memory_utilization: float = 0.3  # share of each GPU for vLLM's weights and KV cache
    vllm_tensor_parallel_size: int = 1        # GPUs (training processes) one engine spans
    vllm_sleep: bool = True         # release vLLM's GPU memory while the trainer trains (CUDA only: off on CPU)
    vllm_max_model_len: int = 0     # prompt + completion tokens vLLM plans for (0: the model's maximum)
    vllm_cpu_kvcache_gib: int = 1   # vLLM's CPU build: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 4
    lr: float = 1e-4
    lr_schedule: str = "constant"   # after warm-up: constant | linear | cosine (to zero at the end)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0          # max gradient norm; 0 = no clipping
    minibatches: int = 1            # optimizer updates per epoch over a batch (whole groups each)
    epochs: int = 1                 # passes over each batch
    async_level: int = 0            # train step s on rollouts of the policy of step s - async_level
    seed: int = 0
    max_nonfinite_updates: int = 3  # stop after this many skipped (NaN/inf) updates in a row
    logprob_chunk: int = 1024       # tokens whose logits exist at once in log-prob passes (0: all, naive)
    micro_batch_size: int = 0       # completions per forward/backward, gradients accumulated (0: a whole minibatch)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass
    mixed_precision: str = "no"     # no | bf16: compute in bfloat16 over float32 weights (FSDP2 or autocast)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 10                 # steps between checkpoints
    keep: int = 2                   # newest checkpoints kept
    keep_every: int = 0             # also keep every checkpoint at a multiple of this step (0: none)


@dataclass(frozen=True)
class VerifierConfig:
    timeout: float = 5.0            # seconds per math-verify call
    workers: int = 2


@dataclass(frozen=True)
class MeasureConfig:
    """The regularized objective measured on held-out prompts (trainer.measure.objective)."""

    prompts: int = 0                # held-out prompts (0: no measurement)
    samples: int = 16               # the policy's completions per prompt at each measurement
    reference_samples: int = 64     # the reference's completions per prompt, once: their rewards give J*
    every: int = 0                  # also measure every N steps (0: the final model only)
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
    raise ConfigError(f"{key}: expected {name}, got {value!r}")


def _reject_unknown(cls: type, data: dict[str, Any], section: str | None) -> None:
    """A ConfigError naming the first key of `data` that `cls` has no field for."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        key, what = (f"{section}.{unknown[0]}", "key") if section else (unknown[0], "section")
        raise ConfigError(f"{key}: unknown {what} (known: {', '.join(known)})")


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
        raise ConfigError(f"{prefix}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    _reject_unknown(cls, data, prefix)
    if cls is ObjectiveConfig:  # the preset's values under the keys given
        try:
            data = presets.expand(data)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    values = {k: _coerce(f"{prefix}.{k}", v, hints[k]) for k, v in data.items()}
    try:
        return cls(**values)
    except ValueError as error:  # ObjectiveConfig's own messages already name the field
        raise ConfigError(str(error).replace("ObjectiveConfig.", "objective.")) from None


def from_dict(data: dict[str, Any]) -> RunConfig:
    """A validated RunConfig from nested plain data."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(data).__name__}")
    hints = _hints(RunConfig)
    _reject_unknown(RunConfig, data, None)
    data = presets.run_defaults(data)  # the rollout keys an objective preset decides, where not given
    names = [f.name for f in dataclasses.fields(RunConfig)]
    config = RunConfig(**{name: _section(hints[name], data.get(name), name) for name in names})
    validate(config)
    return config


def validate(config: RunConfig) -> None:
    """Cross-field checks that need no model or data."""
    m, t, r, c, v = config.model, config.train, config.rollout, config.checkpoint, config.verifier
    if not m.path:
        raise ConfigError("model.path: required (a local model directory or a hub id)")
    if config.task.name not in TASK_NAMES:
        raise ConfigError(f"task.name: {config.task.name!r} is not one of {', '.join(TASK_NAMES)}")
    if r.engine not in ENGINES:
        raise ConfigError(f"rollout.engine: {r.engine!r} is not one of {', '.join(ENGINES)}")
    if r.hf_decoding not in HF_DECODINGS:
        raise ConfigError(f"rollout.hf_decoding: {r.hf_decoding!r} is not one of {', '.join(HF_DECODINGS)}")
    if t.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"train.lr_schedule: {t.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    positive = {"train.steps": t.steps, "train.prompts_per_step": t.prompts_per_step,
                "train.group_size": t.group_size, "train.minibatches": t.minibatches, "train.epochs": t.epochs,
                "train.max_nonfinite_updates": t.max_nonfinite_updates, "rollout.max_new_tokens": r.max_new_tokens,
                "checkpoint.every": c.every, "checkpoint.keep": c.keep, "verifier.workers": v.workers}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    non_negative = {"train.warmup_steps": t.warmup_steps, "train.async_level": t.async_level,
                    "train.weight_decay": t.weight_decay, "train.grad_clip": t.grad_clip,
                    "checkpoint.keep_every": c.keep_every, "train.logprob_chunk": t.logprob_chunk,
                    "train.micro_batch_size": t.micro_batch_size, "rollout.vllm_max_model_len": r.vllm_max_model_len,
                    "measure.prompts": config.measure.prompts, "measure.every": config.measure.every}
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    if config.measure.prompts and min(config.measure.samples, config.measure.reference_samples) < 1:
        raise ConfigError(f"measure.samples and measure.reference_samples: must be >= 1, got "
                          f"{config.measure.samples} and {config.measure.reference_samples}")
    if not t.lr > 0:
        raise ConfigError(f"train.lr: must be > 0, got {t.lr}")
    if v.timeout <= 0:
        raise ConfigError(f"verifier.timeout: must be > 0, got {v.timeout}")
    try:
        advantages.check_group_size(config.objective.advantage, t.group_size, grpo_scale=config.objective.grpo_scale)
    except ValueError as error:
        raise ConfigError(f"train.group_size: {error}") from None
    if config.objective.needs_full_kl and t.logprob_chunk == 0:
        raise ConfigError(f"train.logprob_chunk: estimator {config.objective.estimator} computes the KL over the "
                          "vocabulary a chunk of tokens at a time; set a chunk > 0 (0 would build [B, T, V] logits)")
    if config.objective.entropy_coef and t.logprob_chunk == 0:
        raise ConfigError("train.logprob_chunk: objective.entropy_coef computes the exact entropy a chunk of tokens "
                          "at a time; set a chunk > 0 (0 would build [B, T, V] logits)")
    if t.prompts_per_step % t.minibatches:
        raise ConfigError(f"train.minibatches: {t.minibatches} does not divide prompts_per_step "
                          f"{t.prompts_per_step} (minibatches hold whole groups)")
    if t.micro_batch_size % t.group_size:
        raise ConfigError(f"train.micro_batch_size: {t.micro_batch_size} is not a multiple of group_size "
                          f"{t.group_size} (micro-batches hold whole groups)")
    if t.mixed_precision not in MIXED_PRECISIONS:
        raise ConfigError(f"train.mixed_precision: {t.mixed_precision!r} is not one of {', '.join(MIXED_PRECISIONS)}")
    if not 0 < r.vllm_gpu_memory_utilization <= 1:
        raise ConfigError("rollout.vllm_gpu_memory_utilization: must be in (0, 1], "
                          f"got {r.vllm_gpu_memory_utilization}")
    if r.vllm_cpu_kvcache_gib < 1:
        raise ConfigError(f"rollout.vllm_cpu_kvcache_gib: must be >= 1, got {r.vllm_cpu_kvcache_gib}")
    if r.vllm_tensor_parallel_size < 1:
        raise ConfigError(f"rollout.vllm_tensor_parallel_size: must be >= 1, got {r.vllm_tensor_parallel_size}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    if r.top_p < 1:
        raise ConfigError(f"rollout.top_p: {r.top_p} < 1 samples from the nucleus of each next-token distribution, "
                          "not from the policy, and no importance weight brings back the tokens it never draws: every "
                          "gradient would be biased (docs/top_p.md); train with top_p 1.0 (evaluate.top_p is separate)")
    if not r.temperature > 0:
        raise ConfigError(f"rollout.temperature: must be > 0, got {r.temperature}")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` strings applied to nested data; values are parsed as YAML."""
    data = _plain(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        value = yaml.safe_load(raw) if raw else ""
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = value
    return data


def load(path: Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config (or start from the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"--config: no such file {path}") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"--config: {path} is not valid YAML ({error})") from None
    return from_dict(apply_overrides(data, list(overrides)))


def as_saved(saved: Any) -> Any:
    """A run directory's config.yaml as it compares with a config now: with the keys added to klstudy
    since it was written, at their defaults (such a run still resumes); as saved if it no longer
    validates (then it differs anyway)."""
    try:
        return from_dict(saved).to_dict()
    except ConfigError:
        return saved


def differences(wanted: dict[str, Any], saved: Any) -> list[str]:
    """The `section.key`s where a saved config (as_saved) differs from the wanted one, sorted."""
    saved = saved if isinstance(saved, dict) else {}
    section = lambda data, name: data.get(name) if isinstance(data.get(name), dict) else {}  # noqa: E731
    return sorted(f"{name}.{key}" for name in set(wanted) | set(saved)
                  for key in set(section(wanted, name)) | set(section(saved, name))
                  if section(wanted, name).get(key) != section(saved, name).get(key))
