"""Several training processes on one model: the process group, FSDP2 sharding, and the collectives
the loop needs.

`accelerate launch` (or torchrun) starts one process per GPU and sets RANK, WORLD_SIZE and
LOCAL_RANK; `World.from_environment` joins them. The policy and the reference are sharded with
torch's FSDP2 (`fully_shard`: one unit per decoder layer, plus the root), the same API that
accelerate's FSDP2 plugin applies. It is called directly because accelerate switches FSDP off for
CPU processes (it falls back to DDP there), and the CPU test with gloo must run the same sharding
as the GPUs do. With one process nothing here is used: the model stays a plain module.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """This process's place among the training processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @classmethod
    def from_environment(cls, device: str) -> "World":
        """Join the process group the launcher describes (WORLD_SIZE > 1), or stay alone."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size == 1:
            return cls()
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if on_gpu:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            # gloo for the CPU tensors (object gathers, CPU tests); NCCL for the GPUs' shards
            dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo")
        log.info("process %d of %d (local rank %d)", rank, size, local_rank)
        return cls(rank, size, local_rank)

    def device(self, device: str) -> str:
        """The device of this process: a plain `cuda` or `auto` becomes this process's own GPU."""
        if self.sharded and (device == "cuda" or (device == "auto" and torch.cuda.is_available())):
            return f"cuda:{self.local_rank}"
        return device

    def my_share(self, items: list, parts: int = 1) -> list:
        """This process's items: each of `parts` consecutive parts (minibatches) of `items` is split
        evenly over the processes, so that minibatch m of the whole batch is the union of every
        process's minibatch m."""
        if not self.sharded:
            return list(items)
        per_part = len(items) // parts
        width = per_part // self.size
        return [x for p in range(parts) for x in items[p * per_part + self.rank * width:
                                                       p * per_part + (self.rank + 1) * width]]

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value` (any picklable object), in rank order."""
        if not self.sharded:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def sum(self, value: float) -> float:
        return float(sum(self.gather(value)))

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def close(self) -> None:
        if self.sharded and dist.is_initialized():
            dist.destroy_process_group()


def layer_classes(lm) -> set[str]:
    """The LM's repeated block classes (transformers lists them as _no_split_modules)."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(lm).__name__} names no decoder layer class (_no_split_modules): cannot shard it")
    return names


def shard(module: torch.nn.Module, lm, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 over `module` (which contains the LM `lm`): one unit per decoder layer, the rest in the
    root. With `param_dtype`, parameters are gathered and computed in it while the optimizer keeps
    the stored (float32) ones and gradients are reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    names = layer_classes(lm)
    for sub in lm.modules():
        if type(sub).__name__ in names:
            fully_shard(sub, mp_policy=policy)
    # the root takes ids and masks: nothing of its inputs should be cast
    fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, cast_forward_inputs=False,
                                                       reduce_dtype=policy.reduce_dtype))
    return module


def full_parameters(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter whole, by name (without `prefix`), one at a time: a sharded parameter is
    gathered from every process (all processes must iterate together); a plain one is itself.

    A parameter shared by several modules (tied input and output embeddings) comes under each of
    its names, gathered once: an engine with its own copy may hold the two apart (vLLM's CPU build
    keeps a packed copy of the output layer), and a name it is not sent keeps its old weights."""
    named = [(name[len(prefix):], param) for name, param in module.named_parameters(remove_duplicate=False)
             if name.startswith(prefix)]
    uses = Counter(id(param) for _, param in named)
    shared: dict[int, torch.Tensor] = {}  # gathered tensors of parameters with names still to come
    for name, param in named:
        key = id(param)
        tensor = shared.pop(key, None)
        if tensor is None:
            tensor = param.detach()
            if hasattr(tensor, "full_tensor"):  # a DTensor shard
                tensor = tensor.full_tensor()
        uses[key] -= 1
        if uses[key]:
            shared[key] = tensor
        yield name, tensor


def full_state_dict(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The whole state dict on the CPU of the main process (empty elsewhere), names without `prefix`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load_full_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Load a `full_state_dict` (names without `prefix`) into `module`, sharded or not (every process reads
    the same file, so nothing is broadcast)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, {prefix + k: v for k, v in state.items()},
                         options=StateDictOptions(full_state_dict=True, strict=True))


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter name (the same for any number of processes)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a `full_optimizer_state` (every process reads the same file, so nothing is broadcast)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if all(isinstance(k, int) for k in state.get("state", {})):  # a checkpoint from before named states
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def grad_norm(total: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a float (a DTensor when the parameters are sharded)."""
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return float(total)
