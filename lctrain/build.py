"""Building the runtime pieces in data-flow order: process groups and meshes, the attention
core, the model and data-parallel wrapping.

Used by the training loop and by tools that need a model laid out exactly as in training
(lctrain.memory's measurement, tests, benchmarks).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lctrain.attention import ContextParallelAttention, CPGroups
from lctrain.config import LctrainConfig, derive
from lctrain.launch import env_from_environment
from lctrain.model import AttentionFn, Llama, sdpa_attention
from lctrain.topology import ParallelMesh, Topology


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    topology: Topology
    mesh: ParallelMesh | None
    """Meshes and groups by name (None when running a single process)."""

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """Gradient and loss reduction group."""
        return self.mesh.group("dp_cp") if self.mesh is not None else None


def setup_distributed(cfg: LctrainConfig) -> Runtime:
    env = env_from_environment()
    world = env.world_size if env else 1
    want = cfg.train.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = env.local_rank if env else 0
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    topology = Topology.from_config(cfg, world)
    if world == 1:
        return Runtime(0, 1, device, topology, None)
    if not dist.is_initialized():
        backend = cfg.launch.backend if cfg.launch.backend != "auto" else (
            "nccl" if use_cuda else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.launch.timeout_s))
    return Runtime(dist.get_rank(), world, device, topology, topology.build_mesh(device.type))


def build_attention(cfg: LctrainConfig, rt: Runtime) -> AttentionFn:
    """The attention core the model calls: local SDPA, or the configured cp algorithm."""
    if cfg.parallel.cp == 1:
        return sdpa_attention
    c = rt.topology.coords(rt.rank)
    groups = CPGroups(cp=rt.mesh.group("cp"), ring=rt.mesh.group("cp_ring"),
                      ulysses=rt.mesh.group("cp_ulysses"), ring_size=rt.topology.cp_ring,
                      ring_rank=c["cp_ring"], ulysses_size=rt.topology.cp_ulysses,
                      ulysses_rank=c["cp_ulysses"])
    return ContextParallelAttention(
        cfg.parallel.attention, groups, cfg.train.seq_len, cfg.parallel.load_balance,
        kv_replication=derive(cfg, rt.world_size).kv_replication)


def build_model(cfg: LctrainConfig, device: torch.device,
                attention_fn: AttentionFn = sdpa_attention) -> Llama:
    """Full fp32 model, initialised identically on every rank from train.seed."""
    model = Llama(cfg.model, attention_fn)
    model.init_weights(cfg.train.seed)
    return model.to(device)


def apply_data_parallel(model: Llama, cfg: LctrainConfig, rt: Runtime) -> nn.Module:
    """FSDP2 over dp x cp (each block, then the root), or DDP; identity without dp x cp."""
    if rt.world_size == 1 or rt.topology.group_size("dp_cp") == 1:
        return model
    if cfg.parallel.dp_engine == "ddp":
        return nn.parallel.DistributedDataParallel(model, process_group=rt.dp_cp_group)
    from torch.distributed.fsdp import fully_shard

    dp_cp_mesh = rt.mesh["dp_cp"]
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_cp_mesh)
    fully_shard(model, mesh=dp_cp_mesh)
    return model
