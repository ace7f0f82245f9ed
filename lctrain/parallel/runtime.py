"""The runtime of one rank: its process group, device, meshes and named groups, and everything
derived from the layout that builders and the loop need (`Runtime`), created once by
`setup_distributed`. No parallel state lives anywhere else.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lctrain import device as accelerator
from lctrain.attention import CPGroups
from lctrain.config import Derived, LctrainConfig, derive
from lctrain.config.derived import data_parallel_engine_of, reduces_each_micro_step
from lctrain.layout.topology import AXES, GROUPS, Topology
from lctrain.parallel.launch import env_from_environment


@dataclass(frozen=True)
class ParallelMesh:
    """The root mesh plus one 1-D mesh per named group (flattened ones kept, never re-sliced)."""

    root: DeviceMesh
    meshes: dict[str, DeviceMesh]
    expert_meshes: dict[int, DeviceMesh] = field(default_factory=dict)
    """By ep: the dp x cp x tp ranks as an (edp, ep) mesh (`experts`)."""

    def __getitem__(self, group: str) -> DeviceMesh:
        return self.meshes[group]

    def experts(self, ep: int) -> DeviceMesh:
        """The dp x cp x tp ranks unflattened into (edp, ep): ep consecutive ranks hold the
        experts of a layer between them, the edp ranks of one ep position the same ones
        (collective the first time for each ep). With tensor parallelism the experts are not
        split by TP: the TP ranks, which hold different tokens under SP, are expert ranks
        (docs/parallelism.md §28)."""
        if ep not in self.expert_meshes:  # built on demand: dense models need no such groups
            options = group_options(self.root.device_type)
            ranks = self.root[("dp", "cp_ring", "cp_ulysses", "tp")]._flatten(
                "dp_cp_tp", backend_override=options)
            self.expert_meshes[ep] = ranks._unflatten(
                0, (ranks.size() // ep, ep), ("edp", "ep"),
                backend_override=_each(("edp", "ep"), options))
        return self.expert_meshes[ep]

    def group(self, name: str) -> dist.ProcessGroup:
        """The ProcessGroup of the named group that contains this rank."""
        return self.meshes[name].get_group()


_MESHES: dict[tuple[tuple[int, ...], str], tuple[dist.ProcessGroup, ParallelMesh]] = {}
"""The meshes this process built, by (layout shape, device type), each with the default group it
was built under. Every gloo group holds a transport thread, two worker threads and its sockets
until the process ends (torch keeps the groups of sliced meshes, so they cannot be given back),
so a process that sets up the same layout again (tests, `lctrain plan --calibrate`, several runs
in one process) reuses the groups it has instead of adding ~20 threads per run."""


def mesh_for(topology: Topology, device_type: str) -> ParallelMesh:
    """`build_mesh`, once per layout and default group (collective the first time: every rank
    asks for the same layouts in the same order, as every rank runs the same code)."""
    default, key = dist.distributed_c10d._get_default_group(), (topology.shape, device_type)
    built = _MESHES.get(key)
    if built is None or built[0] is not default:
        built = _MESHES[key] = (default, build_mesh(topology, device_type))
    return built[1]


def build_mesh(topology: Topology, device_type: str) -> ParallelMesh:
    """The 5-D DeviceMesh and its flattened groups (collective: call on all ranks). Every
    group keeps the default group's collective timeout (launch.timeout_s)."""
    options = group_options(device_type)
    root = init_device_mesh(device_type, topology.shape, mesh_dim_names=AXES,
                            backend_override=_each(AXES, options))
    meshes = {axis: root[axis] for axis in AXES}
    for name, (axes, _) in GROUPS.items():
        if len(axes) > 1:
            meshes[name] = root[axes]._flatten(name, backend_override=options)
    return ParallelMesh(root, meshes)


def _each(dims: tuple[str, ...], options) -> dict | None:
    """A mesh's backend_override: `options` for each of `dims` (None: the defaults)."""
    return None if options is None else dict.fromkeys(dims, options)


def group_timeout() -> datetime.timedelta:
    """The default group's collective timeout (init_process_group's, i.e. launch.timeout_s)."""
    default = dist.distributed_c10d._get_default_group()
    return default._get_backend(torch.device("cpu")).options._timeout


def group_options(device_type: str):
    """Backend options for a subgroup carrying `group_timeout()`. torch gives a group made
    without them its own 30-minute default, so a rank that never joins a collective of a
    subgroup (a stopped or hung peer) would hold the others for half an hour, whatever
    launch.timeout_s says."""
    if dist.get_backend() == accelerator.Traced.BACKEND:  # the trace's fake group takes none
        return None
    timeout = group_timeout()
    if device_type == "cuda" and "nccl" in dist.get_backend():
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend

    return Backend.Options("gloo", timeout)


def cp_groups(topology: Topology, mesh: ParallelMesh | None, rank: int) -> CPGroups:
    """`rank`'s context-parallel groups, as the attention algorithms take them."""
    group = (lambda name: mesh.group(name)) if mesh is not None else (lambda name: None)
    return CPGroups(cp=group("cp"), ring=group("cp_ring"), ulysses=group("cp_ulysses"),
                    ring_size=topology.cp_ring,
                    ring_rank=topology.axis_rank(rank, "cp_ring"),
                    ulysses_size=topology.cp_ulysses,
                    ulysses_rank=topology.axis_rank(rank, "cp_ulysses"))


@dataclass(frozen=True)
class Runtime:
    """This rank in its layout: coordinates, groups, device and compute dtype."""

    rank: int
    world_size: int
    device: torch.device
    topology: Topology
    derived: Derived
    mesh: ParallelMesh | None
    """Meshes and groups by name (None when running a single process)."""
    dtype: str = "fp32"
    """train.dtype: the autocast dtype of forward passes."""
    offload_activations: bool = False
    """train.offload_activations: what the backward needs is kept in (pinned) host memory."""
    sync_every_micro_step: bool = False
    """Reduce gradients in every micro-step (`reduces_each_micro_step`)."""
    ep: int = 1
    """parallel.ep: ranks of dp x cp x tp that split the experts between them."""
    deterministic: bool = False
    """train.deterministic: torch's deterministic algorithms for the whole training step."""

    def axis_rank(self, group: str) -> int:
        """This rank's index inside the named group."""
        return self.topology.axis_rank(self.rank, group)

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The named group that contains this rank (None in a single process)."""
        return self.mesh.group(name) if self.mesh is not None else None

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """Gradient and loss reduction group."""
        return self.group("dp_cp")

    def sum_scores(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed in place over dp x cp and the pipeline: evals and validation score on
        every rank of the last pipeline stage, and the other stages add zeros."""
        for name in ("dp_cp", "pp"):
            if self.mesh is not None and self.topology.group_size(name) > 1:
                dist.all_reduce(x, group=self.group(name))
        return x

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype, None for plain fp32."""
        return torch.bfloat16 if self.dtype == "bf16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward passes run in (training and evals alike)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def saved_activations(self) -> contextlib.AbstractContextManager:
        """The context a training forward runs in: with train.offload_activations, every tensor
        autograd saves outside a checkpointed block (with full checkpointing: the block inputs)
        goes to host memory, pinned on CUDA, and comes back for the backward."""
        if not self.offload_activations:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=accelerator.pins(self.device))

    def reproducible(self) -> contextlib.AbstractContextManager:
        """The context a training step runs in: with train.deterministic, torch's deterministic
        algorithms on for all of it (the scatter and index adds of the attention's merge, the
        travelling K/V and the experts' combine use their deterministic CUDA kernels, not
        atomics; an op that has none fails with its name instead of varying)."""
        return accelerator.deterministic_algorithms(self.deterministic)

    @cached_property
    def cp_groups(self) -> CPGroups:
        """This rank's context-parallel groups, as the attention algorithms take them."""
        return cp_groups(self.topology, self.mesh, self.rank)


CUBLAS_DETERMINISTIC = ":4096:8"
"""CUBLAS_WORKSPACE_CONFIG that makes cuBLAS's matmuls deterministic (torch refuses a matmul in
deterministic mode without it); read when the cuBLAS handle is made, so set before CUDA starts."""


def setup_distributed(cfg: LctrainConfig) -> Runtime:
    """The Runtime of this process: joins the process group (torchrun, srun or lctrain's own
    launcher set the environment), picks the device and builds the meshes."""
    env = env_from_environment()
    world = env.world_size if env else 1
    want = cfg.train.device
    use_cuda = want == "cuda" or (want == "auto" and accelerator.available())
    if cfg.train.deterministic:  # before this rank's first matmul makes its cuBLAS handle
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    rank_device = accelerator.training_device(use_cuda, env.local_rank if env else 0)
    topology = Topology.from_config(cfg, world)
    derived = derive(cfg, world)
    extra = {"dtype": cfg.train.dtype, "offload_activations": cfg.train.offload_activations,
             "sync_every_micro_step": reduces_each_micro_step(cfg), "ep": cfg.parallel.ep,
             "deterministic": cfg.train.deterministic}
    if world == 1 and data_parallel_engine_of(cfg, 1) is None:
        return Runtime(0, 1, rank_device, topology, derived, None, **extra)
    if not dist.is_initialized():
        # auto on CUDA: NCCL for CUDA tensors, gloo for the CPU tensors of object collectives
        # (the host shards of FSDP's CPU offload among them)
        backend = cfg.launch.backend if cfg.launch.backend != "auto" else (
            accelerator.backend(use_cuda))
        timeout = datetime.timedelta(seconds=cfg.launch.timeout_s)
        if world == 1:  # a group of one for the engines that keep state on the host
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        else:  # NCCL started now (device_id), not lazily by the first collective of each group
            dist.init_process_group(backend, timeout=timeout,
                                    **accelerator.group_options(rank_device))
    return Runtime(dist.get_rank(), world, rank_device, topology, derived,
                   mesh_for(topology, rank_device.type), **extra)
