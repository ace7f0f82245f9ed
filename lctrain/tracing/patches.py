"""Every torch internal the trace replaces while it observes a step, in one place: what each
patch replaces, why, and the torch versions it was checked on (`CHECKED_ON`: the versions the
trace's equality with a real step, tests/test_trace.py, passed on). A patch is applied only
inside `patched`, and restored on the way out however the block ends. `problems()` names every
patch whose target is gone or no longer what the patch replaces, so a torch upgrade that moves
one fails a test (tests/test_trace.py) instead of a trace.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

CHECKED_ON = ("2.13.0",)
"""torch versions the trace's tests passed on with these patches (the GPU machine's 2.11 has
not run them yet)."""

_ABSENT = object()


@dataclass(frozen=True)
class Patch:
    owner: str
    """The importable path of the class or module that holds the replaced attribute."""
    name: str
    """The attribute replaced."""
    why: str
    """What the trace would get wrong without it."""

    def target(self) -> object:
        module, _, attr = self.owner.rpartition(".")
        try:
            return importlib.import_module(self.owner)
        except ModuleNotFoundError:
            return getattr(importlib.import_module(module), attr)


STORAGE_RESIZE = Patch(
    "torch.UntypedStorage", "resize_",
    "FSDP frees and refills its gathered weights by resizing their storages, which the "
    "dispatcher never sees: StepMemory follows each storage at its current size")
PROFILER_ENTER = Patch(
    "torch.autograd.profiler.record_function", "__enter__",
    "profiler annotations allocate nothing; under a second dispatch mode torch's selective "
    "checkpointing meets the ones FSDP makes in a recompute but not in the forward")
PROFILER_EXIT = Patch("torch.autograd.profiler.record_function", "__exit__",
                      PROFILER_ENTER.why)
TENSOR_TO = Patch(
    "torch.Tensor", "to",
    "HostMoves: a move between host and device inside autograd's backward (FSDP's gradient "
    "offload) runs with no function mode active, and the dispatcher never sees a move to the "
    "device a tensor is on already")
TENSOR_CPU = Patch("torch.Tensor", "cpu", TENSOR_TO.why)
PIPELINE_P2P = Patch(
    "torch.distributed.pipelining.schedules", "_batch_p2p",
    "the pipeline schedule's sends and receives keep their tensors until waited for, as NCCL "
    "does (_HeldWork); the fake process group completes them at once")

PATCHES = (STORAGE_RESIZE, PROFILER_ENTER, PROFILER_EXIT, TENSOR_TO, TENSOR_CPU, PIPELINE_P2P)


def problems(patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    """What no longer applies: a patch whose owner cannot be imported, or whose attribute is
    missing or not callable."""
    out = []
    for p in patches:
        try:
            owner = p.target()
        except (ImportError, AttributeError) as e:
            out.append(f"{p.owner}.{p.name}: {p.owner} is gone ({e})")
            continue
        if not callable(getattr(owner, p.name, None)):
            out.append(f"{p.owner}.{p.name}: no such callable")
    return out


@contextlib.contextmanager
def patched(replacements: dict[Patch, Callable[[Callable], Callable]]) -> Iterator[None]:
    """Inside the block, each patch's attribute is `make(original)`; restored after (an
    attribute the owner inherited is deleted again, not pinned)."""
    saved = []
    try:
        for p, make in replacements.items():
            owner = p.target()
            saved.append((owner, p.name, owner.__dict__.get(p.name, _ABSENT)))
            setattr(owner, p.name, make(getattr(owner, p.name)))
        yield
    finally:
        for owner, name, before in reversed(saved):
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
