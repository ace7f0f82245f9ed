"""Data parallelism over dp x cp (weights are replicated over cp, so gradients are reduced over
both; docs/parallelism.md §9): FSDP2 shards parameters, gradients and optimizer state, DDP
replicates them."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.fsdp import fully_shard

from lctrain.config import LctrainConfig
from lctrain.parallel.runtime import Runtime


def apply_data_parallel(model: nn.Module, cfg: LctrainConfig, rt: Runtime) -> nn.Module:
    """FSDP2 over dp x cp (each block, then the root), or DDP; identity without dp x cp."""
    if rt.world_size == 1 or rt.topology.group_size("dp_cp") == 1:
        return model
    if cfg.parallel.dp_engine == "ddp":
        return nn.parallel.DistributedDataParallel(model, process_group=rt.dp_cp_group)
    dp_cp_mesh = rt.mesh["dp_cp"]
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_cp_mesh)
    fully_shard(model, mesh=dp_cp_mesh)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 wraps nothing: the model is itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Reduce gradients over dp x cp only when `sync` (the last accumulation micro-step)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
