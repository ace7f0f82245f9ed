"""Where a traced step would make the host wait for the GPU (`lctrain plan --trace`'s "host
syncs per step"): the ops that read a device value or size their output by the values, and the
reads through `lctrain.device` (values, counts), each named by its phase and the line of lctrain
that asked (docs/parallelism.md §29).
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten
HOST_SYNC_OPS = {_aten._local_scalar_dense.default: "item", _aten.nonzero.default: "nonzero",
                 _aten._unique2.default: "unique", _aten.unique_dim.default: "unique",
                 _aten.unique_consecutive.default: "unique_consecutive",
                 _aten.bincount.default: "bincount", _aten.masked_select.default: "masked_select",
                 _aten.equal.default: "equal", _aten.is_nonzero.default: "is_nonzero"}
"""Ops that make the host wait for the device when they take a device tensor: a value read
(item, tolist, bool, a Python number), or an output whose size depends on the values (CUDA
reads it back before allocating). torch.repeat_interleave without output_size is one too
(`sync_name`)."""

_PACKAGE = Path(__file__).resolve().parents[1]
_SEAMS = (_PACKAGE / "device.py", _PACKAGE / "tracing" / "trace.py",
          _PACKAGE / "tracing" / "live.py", Path(__file__).resolve())


def _caller() -> str:
    """The innermost line of lctrain outside the device seam and the tracer: where the
    package asked for the value."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(_PACKAGE) and path not in _SEAMS:
            return f"{path.relative_to(_PACKAGE.parent)}:{frame.lineno} ({frame.name})"
    return "outside lctrain"


def sync_name(func, args, kwargs) -> str | None:
    """The host sync `func` makes on these arguments, or None: only on device tensors (fake,
    in a trace; host tensors keep their values and cost no wait)."""
    if not any(isinstance(t, FakeTensor) for t in tree_flatten((args, kwargs))[0]):
        return None
    if func is _aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None:
        return "repeat_interleave without output_size"
    return HOST_SYNC_OPS.get(func)


class HostSyncs:
    """Every moment of a traced step at which the host would wait for the GPU: the ops
    `sync_name` names, and the reads of device values through `lctrain.device` (values,
    counts), each with its phase (forward, backward, optimizer, or the step's own code
    between them) and the line of lctrain that asked."""

    def __init__(self):
        self.seen: Counter = Counter()  # (what, phase, where) -> count
        self.in_forward = 0

    def phase(self, in_optimizer: bool) -> str:
        if in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if self.in_forward else "step"

    def note(self, what: str, in_optimizer: bool) -> None:
        self.seen[(what, self.phase(in_optimizer), _caller())] += 1

    def report(self) -> dict:
        """{"per_step": N, "by_phase": {...}, "sites": [{what, phase, where, count}, ...]}."""
        by_phase = Counter()
        for (_, phase, _), n in self.seen.items():
            by_phase[phase] += n
        sites = [{"what": what, "phase": phase, "where": where, "count": n}
                 for (what, phase, where), n in sorted(self.seen.items(), key=lambda kv: -kv[1])]
        return {"per_step": sum(self.seen.values()), "by_phase": dict(by_phase), "sites": sites}
