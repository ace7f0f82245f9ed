"""Data parallelism over dp x cp (weights are replicated over cp, so gradients are reduced over
both; docs/parallelism.md §9): FSDP2 shards parameters, gradients and optimizer state, DDP
replicates them."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from lctrain import device
from lctrain.config import LctrainConfig
from lctrain.config.derived import data_parallel_engine_of
from lctrain.parallel.experts import expert_modules
from lctrain.parallel.runtime import Runtime


def data_parallel_engine(cfg: LctrainConfig, rt: Runtime) -> str | None:
    """fsdp | ddp | deepspeed, or None when no group reduces gradients (a single rank of
    dp x cp, unless the engine offloads state: `data_parallel_engine_of`)."""
    return data_parallel_engine_of(cfg, rt.world_size)


def apply_fsdp(model: nn.Module, rt: Runtime, offload: bool = False) -> nn.Module:
    """FSDP2 over dp x cp: each block (under expert or tensor parallelism its experts first,
    over the dp x cp x tp / ep ranks that hold the same ones), then the root (on the meta device too: each rank then
    materialises only its shards). Under train.dtype=bf16 the weights are gathered and computed
    with in bf16 while the fp32 shards stay the master weights and gradients are reduced in fp32
    (half the all-gather traffic and gathered-weight memory of fp32). With `offload`
    (parallel.offload_state=optimizer+params) the shards, their gradients and so AdamW's state
    live in host memory (pinned on CUDA), each gather copies a block's shard to the device, and
    the optimizer steps on the host."""
    dp_cp_mesh = rt.mesh["dp_cp"]
    policy = MixedPrecisionPolicy(param_dtype=rt.compute_dtype, reduce_dtype=torch.float32)
    options = {"offload_policy": CPUOffloadPolicy(pin_memory=device.pins(rt.device))} \
        if offload else {}
    for layer in model.layers.values():
        if rt.ep > 1 or rt.topology.tp > 1:  # experts: over the ranks holding the same ones
            for experts in expert_modules(layer):
                fully_shard(experts, mesh=rt.mesh.experts(rt.ep)["edp"], mp_policy=policy,
                            **options)
        fully_shard(layer, mesh=dp_cp_mesh, mp_policy=policy, **options)
    fully_shard(model, mesh=dp_cp_mesh, mp_policy=policy, **options)
    return model


def apply_ddp(model: nn.Module, rt: Runtime) -> nn.Module:
    """DDP over dp x cp (on materialised weights: it broadcasts rank 0's). The only buffers,
    the RoPE frequencies, are computed alike on every rank: no broadcast before each forward.
    Under expert parallelism the experts (different ones on the ranks of an ep group) are left
    out of DDP: `reduce_expert_grads` averages them over the ranks holding the same ones."""
    if rt.ep > 1:
        experts = {id(p) for e in expert_modules(model) for p in e.parameters()}
        ignored = [name for name, p in model.named_parameters() if id(p) in experts]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ignored)
    with device.allocating():  # its buckets: the gradients are views of them
        ddp = nn.parallel.DistributedDataParallel(model, process_group=rt.dp_cp_group,
                                                  broadcast_buffers=False,
                                                  gradient_as_bucket_view=True)
    if dist.get_backend() == device.Traced.BACKEND:  # the trace's fake group returns no result
        ddp.register_comm_hook(None, _reduced_in_place)
    return ddp


def _reduced_in_place(state, bucket):  # (DDP rejects a return annotation made a string)
    """A DDP bucket "all-reduced" in place, as NCCL does (the trace's stand-in): a done
    Future of the bucket's buffer."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, rt: Runtime) -> None:
    """Under DDP with expert parallelism, once per step after the last backward: each expert's
    gradient averaged over the edp ranks that hold it (DDP reduces everything else; FSDP does
    this itself). Their scale, tp/ep, makes the average the mean gradient (§28)."""
    if rt.ep == 1:
        return
    group = rt.mesh.experts(rt.ep)["edp"].get_group()
    for experts in expert_modules(model):
        for p in experts.parameters():
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=group)
            grad /= dist.get_world_size(group)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 wraps nothing: the model is itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Reduce gradients over dp x cp only when `sync` (the last accumulation micro-step; every
    micro-step under FSDP's CPU offload, whose gradients then leave the device each time
    instead of accumulating unsharded there)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
