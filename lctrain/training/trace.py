"""The training step traced at full size without a GPU (`lctrain plan --trace`).

For each rank role of a layout, `trace_role` builds the configured model on that rank exactly as
`lctrain train` does (the same `build_training`: kernel backend, dtype, mixed precision,
checkpointing, tiling, TP, CP, FSDP or DDP, expert parallelism) and runs one whole optimizer step
(every accumulation micro-step, `loop.train_step`) on fake tensors: torch's FakeTensorMode
(`lctrain.device.HostAwareFakeMode`), a fake process group of the real world size, and
`lctrain.device.Traced` in place of the accelerator, so the CUDA code path runs (flash-attention
ops and grouped matmuls on their meta kernels) and nothing is computed or allocated.

`StepMemory` counts the bytes of every storage alive during the step (each op's outputs, until
the last reference goes, at their size after FSDP resizes them) on top of the state that exists
before it: the parameters and, as from the second step on, AdamW's moments (made by a warm-up
step before the trace). Its peak and the parts at that moment are the trace's answer; the same
tracker around a real CPU step measures the same numbers (tests/test_trace.py). What it cannot
see: the caching allocator's rounding and fragmentation, NCCL's buffers, the CUDA context and the
kernels' workspaces (the plan's allocator allowance stands for them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import weakref

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lctrain import device
from lctrain.config import LctrainConfig
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.runtime import setup_distributed
from lctrain.training import loop

PARTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
"""The traced peak's parts: the local parameters (their fp32 shards), the gradients alive, AdamW's
moments, what the forward created and still keeps, and the rest (gathered weights, the
backward's and the optimizer's working memory, communication buffers)."""


def _plain(t: Tensor) -> Tensor:
    """The tensor that holds the memory: a DTensor's local shard, an async collective's result."""
    t = getattr(t, "_local_tensor", t)
    return getattr(t, "elem", t)


class StepMemory(TorchDispatchMode):
    """Bytes alive in the storages ops create, by the phase that created them (forward, or
    backward: inside autograd's engine), on top of `state` (bytes that exist before the step);
    the peak and the created bytes by phase at that moment. Storages are followed by weak
    reference and their resizes (FSDP frees and refills gathered weights that way) by a patch of
    `UntypedStorage.resize_` while the tracker is active. `host` lists storages that live in
    host memory (offloaded state): not counted."""

    def __init__(self, state: int, host: set[int] | None = None):
        super().__init__()
        self.state, self.host = state, host or set()  # host: ids of storages
        self.live: dict[int, list] = {}  # id(storage) -> [bytes, phase, op index]
        self.by_phase = {"forward": 0, "backward": 0}
        self.ops = 0
        self.peak, self.peak_op, self.at_peak = state, -1, dict(self.by_phase)
        self._resize = None

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            out = original(storage, size)
            tracker._resized(storage)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        inputs = {id(_plain(t).untyped_storage())
                  for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for t in tree_flatten(out)[0]:  # new storages only: not views or in-place results
            if isinstance(t, Tensor) and id(_plain(t).untyped_storage()) not in inputs:
                self._track(_plain(t).untyped_storage())
        self._update_peak()
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self.live or key in self.host:
            return
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.live[key] = [storage.nbytes(), phase, self.ops]
        self.by_phase[phase] += storage.nbytes()
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        nbytes, phase, _ = self.live.pop(key)
        self.by_phase[phase] -= nbytes

    def _resized(self, storage) -> None:
        entry = self.live.get(id(storage))
        if entry is not None:
            self.by_phase[entry[1]] += storage.nbytes() - entry[0]
            entry[0] = storage.nbytes()
            self._update_peak()

    def _update_peak(self) -> None:
        total = self.state + self.by_phase["forward"] + self.by_phase["backward"]
        if total > self.peak:
            self.peak, self.peak_op, self.at_peak = total, self.ops, dict(self.by_phase)

    def created_before_peak(self, storage) -> bool:
        entry = self.live.get(id(storage))
        return entry is not None and entry[2] <= self.peak_op


def _storages(tensors) -> dict[int, int]:
    """Distinct storages of `tensors` (local shards): {id: bytes}."""
    out = {}
    for t in tensors:
        if isinstance(t, Tensor):
            storage = _plain(t).untyped_storage()
            out[id(storage)] = storage.nbytes()
    return out


def _device_bytes(tensors, host: set[int]) -> int:
    return sum(n for key, n in _storages(tensors).items() if key not in host)


def _state_tensors(optimizer) -> list[Tensor]:
    return [v for state in optimizer.state.values() for k, v in state.items()
            if k != "step" and isinstance(v, Tensor)]


def _host_storages(cfg: LctrainConfig, model: nn.Module, optimizer) -> set[int]:
    """Ids of the storages parallel.offload_state keeps in host memory."""
    mode = cfg.parallel.offload_state
    if mode == "none":
        return set()
    tensors = _state_tensors(optimizer)
    if mode == "optimizer":
        tensors += [t for pair in optimizer.buffers.values() for t in pair]
    else:
        tensors += list(model.parameters())
    return set(_storages(tensors))


def warm_optimizer(model: nn.Module, optimizer) -> None:
    """AdamW's state as from the second step on (it makes its moments in its first step): one
    step on zero gradients, which are then dropped."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_step(cfg: LctrainConfig, model: nn.Module, optimizer, scheduler, micro_batches,
                 rt) -> dict:
    """One `loop.train_step` under `StepMemory`, the optimizer's state made beforehand
    (`warm_optimizer`): the peak bytes of this rank's device memory and its parts (`PARTS`).
    Works alike on real tensors and in a trace."""
    warm_optimizer(model, optimizer)
    host = _host_storages(cfg, model, optimizer)
    params = _device_bytes(list(model.parameters()) + list(model.buffers()), host)
    moments = _device_bytes(_state_tensors(optimizer), host)
    tracker = StepMemory(params + moments, host)
    grads: dict[int, int] = {}

    def seen_grads(opt, args, kwargs):  # the gradients as the optimizer gets them
        for p in model.parameters():
            if p.grad is not None:
                storage = _plain(p.grad).untyped_storage()
                if tracker.created_before_peak(storage):
                    grads[id(storage)] = storage.nbytes()

    hook = optimizer.register_step_pre_hook(seen_grads)
    started = time.perf_counter()
    try:
        with tracker:
            loop.train_step(model, optimizer, scheduler, micro_batches, cfg, rt)
    finally:
        hook.remove()
    gradients = sum(grads.values())
    backward = tracker.at_peak["backward"] - gradients
    return {"peak": tracker.peak,
            "parts": {"parameters": params, "gradients": gradients, "optimizer_state": moments,
                      "activations": tracker.at_peak["forward"], "temporaries": backward},
            "ops": tracker.ops, "seconds": time.perf_counter() - started}


def roles(cfg: LctrainConfig, world_size: int) -> list[tuple[int, str]]:
    """(rank, what it stands for) of each distinct rank role: rank 0 stands for every rank
    (every rank of a layout without pipelining holds the same shapes)."""
    return [(0, f"every rank ({world_size})")]


@contextlib.contextmanager
def _rank_environment(rank: int, world_size: int, local_rank: int):
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LCTRAIN_LAUNCHER")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      LCTRAIN_LAUNCHER="trace")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def trace_role(cfg: LctrainConfig, world_size: int, rank: int, gpus_per_node: int = 8,
               cuda: bool = True) -> dict:
    """`measure_step` for `rank` of `world_size` traced in this process (which must not be in a
    process group): the CUDA code path unless `cuda` is False (the CPU path, which a real CPU
    run can be compared with)."""
    if dist.is_initialized():
        raise RuntimeError("lctrain plan --trace runs in a process outside any process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, device="cuda" if cuda else "cpu"))
    mode = device.HostAwareFakeMode()
    accelerator = device.Traced(mode, gpus_per_node, cuda=cuda)
    dist.init_process_group(device.Traced.BACKEND, store=FakeStore(), rank=rank,
                            world_size=world_size)
    try:
        with _rank_environment(rank, world_size, rank % gpus_per_node), \
                device.tracing(accelerator):
            rt = setup_distributed(cfg)
            started = time.perf_counter()
            model, optimizer, scheduler, loader = loop.build_training(cfg, rt)
            built = time.perf_counter() - started
            micro_batches = loader.next_step()
            with mode:
                out = measure_step(cfg, model, optimizer, scheduler, micro_batches, rt)
        params = sum(_plain(p).numel() for p in unwrap(model).parameters())
        return out | {"rank": rank, "build_seconds": built, "local_parameters": params}
    finally:
        dist.destroy_process_group()
