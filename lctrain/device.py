"""The one seam between lctrain and the accelerator: every `torch.cuda.*` call and every "is this
the CUDA path" decision of the package goes through the operations here (device choice and
count, the process-group backend, pinning, synchronisation, the allocator's peak, RNG state,
host reads of values the device computed): `device.values(t)` and the like, each the current
accelerator's method (`OPERATIONS`), stated once in `Accelerator`.

`lctrain plan --trace` (lctrain.tracing.trace) swaps the accelerator for `Traced`: the CUDA
code path (flash kernels, grouped matmuls, bf16 rules) runs on fake CPU tensors under torch's
FakeTensorMode and a fake process group, so a whole training step executes symbolically at full
size on a machine without a GPU. Code that asks `gpu_path(device)` takes the CUDA branch; what
needs a real GPU (pinning, streams, the allocator's statistics, RNG state) is answered without
one; host reads of device values (`values`, `counts`) return placeholders (ones; a
balanced split), since a fake tensor has no data, and are told to the trace's count of host
syncs (`Traced.on_read`).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten


class Accelerator:
    """CUDA when this process has one, else the CPU: what `lctrain train` runs on."""

    traced = False

    def gpu_path(self, device: torch.device) -> bool:
        """Whether work on `device` takes the CUDA code path (flash kernels, grouped matmuls)."""
        return device.type == "cuda"

    def available(self) -> bool:
        return torch.cuda.is_available()

    def initialized(self) -> bool:
        """Whether this process initialised CUDA (ranks forked from it could not use it)."""
        return torch.cuda.is_initialized()

    def count(self) -> int:
        """GPUs this process can see, through NVML: a process that initialised CUDA (as
        torch.cuda.is_available() does by default) can no longer fork ranks that use it."""
        if not torch.backends.cuda.is_built():
            return 0
        previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        try:
            return torch.cuda.device_count() if torch.cuda.is_available() else 0
        finally:
            if previous is None:
                del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
            else:
                os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous

    def training_device(self, use_gpu: bool, local_rank: int) -> torch.device:
        """The device a rank trains on (set as the current CUDA device on a GPU)."""
        if not use_gpu:
            return torch.device("cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def backend(self, use_gpu: bool) -> str:
        """The process-group backend of train.device's choice (launch.backend=auto): NCCL for
        CUDA tensors and gloo for the CPU tensors of object collectives and host shards."""
        return "cuda:nccl,cpu:gloo" if use_gpu else "gloo"

    def name(self, device: torch.device) -> str:
        """The GPU's product name."""
        return torch.cuda.get_device_name(device)

    def group_options(self, device: torch.device) -> dict:
        """init_process_group's options for a rank on `device`: on CUDA its device, so NCCL
        connects every group's communicator when the group is made, not at its first call."""
        return {"device_id": device} if device.type == "cuda" else {}

    def pins(self, device: torch.device) -> bool:
        """Whether host buffers that feed `device` are pinned (page-locked)."""
        return device.type == "cuda"

    def synchronize(self, device: torch.device) -> None:
        """Wait for `device`'s queued work (no-op on the CPU)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def reset_peak(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def peak_allocated(self, device: torch.device) -> int:
        """The allocator's peak of allocated bytes since `reset_peak`."""
        return torch.cuda.max_memory_allocated(device)

    def rng_state(self) -> list[int] | None:
        """The CUDA RNG state (None when CUDA is not in use)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.get_rng_state().tolist()
        return None

    def set_rng_state(self, state: list[int]) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.tensor(state, dtype=torch.uint8))

    def values(self, t: Tensor) -> float | list:
        """`t`'s values read on the host (`Tensor.tolist`: a number for one element)."""
        return t.tolist()

    def counts(self, t: Tensor, total: int | list[int]) -> list:
        """Counts (an integer tensor [..., n] of rows of n, each summing to its total: `total`, or
        total[i] for row i of the leading dimensions flattened) read on the host as nested lists:
        the split sizes of an uneven all-to-all or of per-expert matmuls. In a trace, a balanced
        split of each total."""
        return t.tolist()

    def allocate(self, model: torch.nn.Module, on: torch.device) -> None:
        """Storage (uninitialised) on `on` for the parameters and buffers of a model built on the
        meta device, swapped in place: a tied weight stays one parameter, and the references
        FSDP keeps stay valid."""
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.to_empty(device=on)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)

    def holds_values(self) -> bool:
        """Whether tensors hold values (not in a trace: weights are then allocated, never filled)."""
        return True

    def allocating(self) -> contextlib.AbstractContextManager:
        """The context in which a wrapper allocates its own buffers (DDP's gradient buckets)."""
        return contextlib.nullcontext()

    def host(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class Traced(Accelerator):
    """The CUDA code path on fake CPU tensors (lctrain.tracing.trace): `gpu_path` is true for
    the CPU device the fake tensors live on (with `cuda=False`, the CPU path, to compare with a
    real CPU run), nothing touches a GPU, `fake_mode` allocates the
    model, and host reads of device values return placeholders (ones; finite: yes, so the
    optimizer step is traced too)."""

    traced = True
    BACKEND = "fake"

    def __init__(self, fake_mode, gpus: int, cuda: bool = True):
        self.fake_mode, self.gpus, self.cuda = fake_mode, gpus, cuda
        self.on_read = None
        """Called with the reader's name at each host read of device values (or None)."""

    def gpu_path(self, device: torch.device) -> bool:
        return self.cuda

    def available(self) -> bool:
        return True

    def initialized(self) -> bool:
        return False

    def count(self) -> int:
        return self.gpus

    def training_device(self, use_gpu: bool, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def backend(self, use_gpu: bool) -> str:
        return self.BACKEND

    def name(self, device: torch.device) -> str:
        return "traced"

    def group_options(self, device: torch.device) -> dict:
        return {}

    def pins(self, device: torch.device) -> bool:
        return False

    def synchronize(self, device: torch.device) -> None:
        pass

    def reset_peak(self, device: torch.device) -> None:
        pass

    def peak_allocated(self, device: torch.device) -> int:
        return 0

    def rng_state(self) -> list[int] | None:
        return None

    def set_rng_state(self, state: list[int]) -> None:
        pass

    def values(self, t: Tensor) -> float | list:
        if not isinstance(t, FakeTensor):  # the host's own values (the batch's)
            return t.tolist()
        self.read("values")
        with unset_fake_temporarily():
            return torch.ones(tuple(t.shape), dtype=t.dtype).tolist()

    def counts(self, t: Tensor, total: int | list[int]) -> list:
        """Each [n] row of counts summing to its total, spread as evenly as it goes (a
        balanced load: a fake tensor has no values)."""
        if not isinstance(t, FakeTensor):  # the host's own counts
            return t.tolist()
        self.read("counts")
        n, rows = t.shape[-1], t.numel() // t.shape[-1]
        totals = [total] * rows if isinstance(total, int) else total
        assert len(totals) == rows, (t.shape, totals)
        with unset_fake_temporarily():
            return torch.tensor([[s // n + (i < s % n) for i in range(n)] for s in totals]
                                ).reshape(t.shape).tolist()

    def read(self, what: str) -> None:
        """A host read of device values: told to `on_read` (the trace's sync counter)."""
        if self.on_read is not None:
            self.on_read(what)

    def allocate(self, model: torch.nn.Module, on: torch.device) -> None:
        """Fake storage from each meta tensor's shape. A DTensor parameter (TP, FSDP) is swapped
        in place as `Accelerator.allocate` does; a plain one is replaced wherever it is
        registered, by one new parameter per old one (ties kept): torch cannot swap a fake
        tensor in (the fake mode keeps a weak reference to it)."""
        made: dict[int, Tensor] = {}
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for key, t in table.items():
                    if t is None or not getattr(t, "_local_tensor", t).is_meta and id(t) not in made:
                        continue
                    if id(t) not in made:
                        made[id(t)] = self._fake_like(t)
                    table[key] = made[id(t)]

    def _fake_like(self, t: Tensor) -> Tensor:
        local = getattr(t, "_local_tensor", t)
        with self.fake_mode:
            fake = torch.empty(local.shape, dtype=local.dtype)
        if isinstance(t, DTensor):
            new = DTensor.from_local(fake, t.device_mesh, t.placements, run_check=False,
                                     shape=t.shape, stride=t.stride())
            if isinstance(t, torch.nn.Parameter):
                torch.utils.swap_tensors(t, torch.nn.Parameter(new, t.requires_grad))
                return t
            return new
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(fake, t.requires_grad)
        return fake

    def holds_values(self) -> bool:
        return False

    @contextlib.contextmanager
    def allocating(self):
        """The fake mode, and DDP's check that every rank's parameters have the same shapes
        (a C++ collective that reads the data) skipped: every rank of a trace is this one."""
        from torch.nn.parallel import distributed  # torch's own module, patched for the block

        verify = distributed._verify_param_shape_across_processes
        distributed._verify_param_shape_across_processes = lambda *args, **kwargs: None
        try:
            with self.fake_mode:
                yield
        finally:
            distributed._verify_param_shape_across_processes = verify

    def host(self) -> contextlib.AbstractContextManager:
        return unset_fake_temporarily()


class HostAwareFakeMode(FakeTensorMode):
    """torch's FakeTensorMode (real inputs allowed) for a trace, except that an op whose tensor
    arguments are all plain real tensors runs for real: the host's own tensors (the batch's
    token ids, document ids and positions, and what the attention plans from them) keep their
    values, as on a GPU run, while everything the model allocates (factories included) is fake."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)

    def dispatch(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        if tensors and all(type(t) in (Tensor, torch.nn.Parameter) and not t.is_meta
                           for t in tensors):
            return func(*args, **(kwargs or {}))
        return super().dispatch(func, types, args, kwargs or {})


_current: Accelerator = Accelerator()


def current() -> Accelerator:
    """The accelerator in use: the real one, or `Traced` inside `tracing`."""
    return _current


OPERATIONS = frozenset(name for name, member in vars(Accelerator).items()
                       if callable(member) and not name.startswith("_"))
"""What the package asks of the accelerator, each stated once, as a method of `Accelerator`
(and again in `Traced` where a trace answers otherwise)."""


def __getattr__(name: str):
    """`device.X` is the current accelerator's X for every operation: looked up when called, so
    a trace's `Traced` answers inside `tracing` (import the module, never the names)."""
    if name in OPERATIONS:
        return getattr(_current, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def tracing(accelerator: Traced):
    """Inside the block the package runs on `accelerator` (one trace at a time per process)."""
    global _current
    previous, _current = _current, accelerator
    try:
        yield accelerator
    finally:
        _current = previous


@contextlib.contextmanager
def deterministic_algorithms(on: bool = True):
    """torch's deterministic-algorithms switch on inside the block when `on`, restored after
    (CUDA kernels read it at launch: torch's flash backward, index_add_, scatter_add_)."""
    if not on:
        yield
        return
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def on_host(fn):
    """Decorator for host-side planning (the attention's blocks and their kernel calls): `fn`
    works on real host tensors, also inside a trace (outside its fake mode)."""
    @functools.wraps(fn)
    def planned(*args, **kwargs):
        with _current.host():
            return fn(*args, **kwargs)
    return planned
