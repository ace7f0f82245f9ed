"""Data parallelism over dp x cp (weights are replicated over cp, so gradients are reduced over
both; docs/parallelism.md §9): FSDP2 shards parameters, gradients and optimizer state, DDP
replicates them."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lctrain.config import LctrainConfig
from lctrain.parallel.runtime import Runtime


def data_parallel_engine(cfg: LctrainConfig, rt: Runtime) -> str | None:
    """fsdp | ddp, or None when no group reduces gradients (a single rank of dp x cp)."""
    if rt.world_size == 1 or rt.topology.group_size("dp_cp") == 1:
        return None
    return cfg.parallel.dp_engine


def apply_fsdp(model: nn.Module, rt: Runtime) -> nn.Module:
    """FSDP2 over dp x cp: each block, then the root (on the meta device too: each rank then
    materialises only its shards). Under train.dtype=bf16 the weights are gathered and computed
    with in bf16 while the fp32 shards stay the master weights and gradients are reduced in fp32
    (half the all-gather traffic and gathered-weight memory of fp32)."""
    dp_cp_mesh = rt.mesh["dp_cp"]
    policy = MixedPrecisionPolicy(param_dtype=rt.compute_dtype, reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_cp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_cp_mesh, mp_policy=policy)
    return model


def apply_ddp(model: nn.Module, rt: Runtime) -> nn.Module:
    """DDP over dp x cp (on materialised weights: it broadcasts rank 0's). The only buffers,
    the RoPE frequencies, are computed alike on every rank: no broadcast before each forward."""
    return nn.parallel.DistributedDataParallel(model, process_group=rt.dp_cp_group,
                                               broadcast_buffers=False)


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
