"""The training step traced at full size without a GPU (`lctrain plan --trace`).

For each rank role of a layout, `trace_role` builds the configured model on that rank exactly as
`lctrain train` does (the same `build_training`: kernel backend, dtype, mixed precision,
checkpointing, tiling, TP, CP, FSDP or DDP, expert parallelism) and runs one whole optimizer step
(every accumulation micro-step, `train_step`) on fake tensors: torch's FakeTensorMode
(`lctrain.device.HostAwareFakeMode`), a fake process group of the real world size, and
`lctrain.device.Traced` in place of the accelerator, so the CUDA code path runs (flash-attention
ops and grouped matmuls on their meta kernels) and nothing is computed or allocated.

`StepMemory` (the one tracker of live bytes, `lctrain.tracing.live`) counts the bytes of every
storage alive during the step (each op's outputs, until the last reference goes, at their size
after FSDP resizes them) on top of the state that exists before it: the parameters and, as from
the second step on, AdamW's moments (made by a warm-up step before the trace). Its peak and the parts at that moment are the trace's answer; the same
tracker around a real CPU step measures the same numbers (tests/test_trace.py). What it cannot
see: the caching allocator's rounding and fragmentation, NCCL's buffers, the CUDA context and the
kernels' workspaces (the plan's allocator allowance stands for them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from lctrain import device
from lctrain.attention.varlen_reference import FLASH_OPS, check_flash_call
from lctrain.config import LctrainConfig
from lctrain.layout.stages import stages_of
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.launch import run_ranks
from lctrain.parallel.runtime import setup_distributed
from lctrain.tracing import patches
from lctrain.tracing.host_syncs import HostSyncs, sync_name
from lctrain.tracing.live import LiveBytes, holding_tensor, storage_of
from lctrain.tracing.measure import host_state_tensors, optimizer_state_tensors
from lctrain.tracing.patches import patched
from lctrain.training import loop
from lctrain.training.step import train_step

PARTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
"""The traced peak's parts: the local parameters (their fp32 shards and buffers), the gradients
alive (the parameters' own, and FSDP's unsharded ones kept between accumulation micro-steps),
AdamW's moments, what forward passes made that is still alive (what they keep for the backward,
and at a peak inside a forward its working tensors), and the rest (what backward passes and the
optimizer made: gathered weights, working tensors, communication buffers)."""


class StepMemory(LiveBytes):
    """The live bytes of a training step (`LiveBytes`) on top of `state` (bytes that exist
    before it), with the flash kernels' contract checked and the host syncs noted (`syncs`) on
    the way. `gradients`: storages marked as gradients (`mark_gradients`), with the op indices
    at which they were made and freed."""

    def __init__(self, state: int, host: set[int] | None = None,
                 syncs: HostSyncs | None = None):
        super().__init__(state, host=host)
        self.syncs = syncs
        self.gradients: dict[int, list] = {}  # id(storage) -> [bytes, made, freed or None]
        self.standing: dict[int, int] = {}  # gradient storages older than the step

    def run(self, func, args, kwargs):
        if func in FLASH_OPS:  # the CUDA kernel's rules, which its meta kernel does not check
            check_flash_call(func, args)
        sync = None if self.syncs is None else sync_name(func, args, kwargs)
        if sync is not None:
            self.syncs.note(sync, self.in_optimizer)
            if func is torch.ops.aten._local_scalar_dense.default:  # a placeholder: the trace goes on
                return True if args[0].dtype == torch.bool else 1
        return func(*args, **kwargs)

    def freed(self, key: int) -> None:
        if key in self.gradients:
            self.gradients[key][2] = self.ops

    def mark_gradients(self, tensors) -> None:
        """Record these (alive) tensors' storages as gradients: made by the step, or standing
        (made before it and alive throughout, as DDP's buckets, whose views the gradients are)."""
        for t in tensors:
            storage = storage_of(t)
            key = id(storage)
            entry = self.live.get(key)
            if entry is not None and key not in self.gradients:
                self.gradients[key] = [entry[0], entry[2], None]
            elif entry is None and key not in self.host:
                self.standing[key] = storage.nbytes()

    def gradients_at_peak(self) -> int:
        return sum(n for n, made, freed in self.gradients.values()
                   if made <= self.peak_op and (freed is None or freed > self.peak_op))


class HostMoves:
    """In a trace the CPU device stands for both the GPU and the host, told apart by storage:
    `tracker.host` holds the host's. `Tensor.to` a CPU device and `Tensor.cpu` on a fake tensor
    then cross sides, as on a GPU: from the device, a copy in host memory (FSDP's offloaded
    gradients, activations saved on the host); from the host, a copy on the device (FSDP's
    offloaded shards before their all-gather, saved activations coming back).

    The two methods are patched on `torch.Tensor` while the block runs: a torch function mode
    would miss the moves made inside autograd's backward (FSDP offloads each gradient there,
    in its post-backward hook), where torch runs with no function mode active; and the
    dispatcher never sees a move to the device a tensor is already on."""

    def __init__(self, tracker: StepMemory):
        self.tracker = tracker
        self._patches = contextlib.ExitStack()

    def __enter__(self):
        self._patches.enter_context(patched({
            p: lambda original, name=p.name: self._moving(name, original)
            for p in (patches.TENSOR_TO, patches.TENSOR_CPU)}))
        return self

    def __exit__(self, *exc):
        self._patches.close()

    def _moving(self, name: str, original):
        def method(t, *args, **kwargs):
            if isinstance(t, FakeTensor):
                target = kwargs.get("device", args[0] if args else None)
                if name == "cpu" or isinstance(target, (str, torch.device)) and \
                        torch.device(target).type == "cpu":
                    return self._cross(t)
            return original(t, *args, **kwargs)
        return method

    def _cross(self, t: Tensor) -> Tensor:
        to_host = id(storage_of(t)) not in self.tracker.host
        out = torch.empty_like(t)
        out.copy_(t)
        if to_host:
            self.tracker.on_host(storage_of(out))
        return out


def _storages(tensors) -> dict[int, int]:
    """Distinct storages of `tensors` (local shards): {id: bytes}."""
    return {id(storage_of(t)): storage_of(t).nbytes() for t in tensors if isinstance(t, Tensor)}


def _device_bytes(tensors, host: set[int]) -> int:
    return sum(n for key, n in _storages(tensors).items() if key not in host)


def _gradients(model: nn.Module) -> list[Tensor]:
    """The gradients alive now: the parameters' own, and the unsharded ones FSDP accumulates
    between micro-steps (torch's FSDP2 keeps them on its FSDPParam objects)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if grad is not None:
                grads.append(grad)
    return grads


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
    """One `train_step` under `StepMemory`, the optimizer's state made beforehand
    (`warm_optimizer`): the peak bytes of this rank's device memory, its parts (`PARTS`) and
    where it happened. Works alike on real tensors and in a trace."""
    warm_optimizer(model, optimizer)
    host = set(_storages(host_state_tensors(model, optimizer, cfg.parallel.offload_state)))
    params = _device_bytes(list(model.parameters()) + list(model.buffers()), host)
    moments = _device_bytes(optimizer_state_tensors(optimizer), host)
    accelerator = device.current()
    # device values exist apart from the host's in a trace only
    syncs = HostSyncs() if isinstance(accelerator, device.Traced) else None
    tracker = StepMemory(params + moments, host, syncs)

    def micro_step(module, args):  # a micro-step starts: the gradients so far are made
        tracker.mark_gradients(_gradients(model))
        tracker.micro_step += 1

    def optimizer_step(opt, args, kwargs):
        tracker.mark_gradients(_gradients(model))
        tracker.in_optimizer = True

    def forwarding(depth: int):
        def hook(*_):
            if syncs is not None:
                syncs.in_forward += depth
        return hook

    # a micro-step starts with a forward of the model, or under pipelining of the rank's first
    # stage (the schedule calls the stages)
    parts = [unwrap(p) for p in (model.parts.values() if hasattr(model, "parts") else [model])]
    hooks = [parts[0].register_forward_pre_hook(micro_step),
             optimizer.register_step_pre_hook(optimizer_step),
             optimizer.register_step_post_hook(
                 lambda *_: setattr(tracker, "in_optimizer", False))]
    for part in parts:
        hooks += [part.register_forward_pre_hook(forwarding(1)),
                  part.register_forward_hook(forwarding(-1), always_call=True)]
    if syncs is not None:
        accelerator.on_read = lambda what: syncs.note(f"device.{what}", tracker.in_optimizer)
    started = time.perf_counter()
    try:
        # on the CPU path host and device are one memory: nothing crosses
        crossing = HostMoves(tracker) if device.gpu_path(rt.device) else contextlib.nullcontext()
        gc.collect()  # no earlier garbage freed inside the step; and none collected during it:
        gc.disable()  # what reference cycles hold then lives to the step's end, every time
        with tracker, crossing:
            train_step(model, optimizer, scheduler, micro_batches, cfg, rt)
    finally:
        gc.enable()
        for hook in hooks:
            hook.remove()
        if syncs is not None:
            accelerator.on_read = None
    made = tracker.gradients_at_peak()  # made by backward passes
    standing = sum(tracker.standing.values())  # alive all along: the peak is where it was
    phase, step, func = tracker.peak_where
    return {"peak": tracker.peak + standing,
            "parts": {"parameters": params, "gradients": made + standing,
                      "optimizer_state": moments,
                      "activations": tracker.at_peak["forward"],
                      "temporaries": tracker.at_peak["backward"] + tracker.at_peak["optimizer"]
                      - made},
            "at": {"phase": phase, "micro_step": step, "micro_steps": len(micro_batches),
                   "op": str(func)},
            "largest_at_peak": tracker.largest_at_peak(),
            "host_syncs": None if syncs is None else syncs.report(),
            "ops": tracker.ops, "seconds": time.perf_counter() - started}


def roles(cfg: LctrainConfig, world_size: int) -> list[tuple[int, int, str]]:
    """(rank, pipeline rank, what it stands for) of each distinct rank role: the first rank of
    each pipeline rank (every rank of a pipeline rank holds the same shapes: TP, CP and DP
    split alike, the experts evenly)."""
    pp = cfg.parallel.pp
    if pp == 1:
        return [(0, 0, f"every rank ({world_size})")]
    return [(r * world_size // pp, r, f"pipeline rank {r}, stages "
             f"{','.join(map(str, stages_of(cfg, r)))}") for r in range(pp)]


class _HeldWork:
    """A fake process group's point-to-point Work that keeps its tensors until it is waited
    for, as gloo's and NCCL's do (a fake one drops them at once)."""

    def __init__(self, work, tensors: list[Tensor]):
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        self.tensors = None
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextlib.contextmanager
def _sends_held():
    """Inside the block the pipeline schedule's sends and receives keep their tensors alive
    until waited for (`_HeldWork`)."""
    def holding(original):
        def batch(ops, desc=None):
            return [_HeldWork(w, [op.tensor for op in ops]) for w in original(ops, desc)]
        return batch

    with patched({patches.PIPELINE_P2P: holding}):
        yield


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
            with mode, _sends_held():
                out = measure_step(cfg, model, optimizer, scheduler, micro_batches, rt)
        params = sum(holding_tensor(p).numel() for p in unwrap(model).parameters())
        return out | {"rank": rank, "build_seconds": built, "local_parameters": params}
    finally:
        dist.destroy_process_group()


def trace_apart(cfg: LctrainConfig, world_size: int, rank: int, gpus_per_node: int = 8,
                cuda: bool = True) -> dict:
    """`trace_role` in a process of its own (forked): each trace sets up its own fake world,
    which torch's process-group registry does not forget within a process."""
    return run_ranks(trace_role, 1, (cfg, world_size, rank, gpus_per_node, cuda),
                     start_method="fork", threads=1, backend=None)[0]
