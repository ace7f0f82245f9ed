"""The one tracker of live bytes: every storage that an op creates while it is active, followed
until its last reference goes, at its size now.

`LiveBytes` is a TorchDispatchMode, so it sees DTensor local shards, checkpointing and custom
autograd functions alike, real tensors and fake ones. It counts an op's new storages only (not
its inputs': views and in-place results), keyed by the storage object (which torch keeps as long
as the storage lives, so a weak reference's callback says when the memory goes back), and follows
their resizes (FSDP frees and refills gathered weights that way) by a patch of
`UntypedStorage.resize_` while it is active. Each storage is labelled with the phase that made
it (forward; backward: inside autograd's engine; optimizer) and with `where` (a caller's label,
e.g. the layer running). The peak of the total, when it happened and what was alive then are
kept.

Its users: the trace of a whole step and the same step measured on real tensors
(`lctrain.tracing.trace.StepMemory`), the activations a forward leaves for its backward and the
peak of any block of code (`lctrain.tracing.measure`).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lctrain.tracing import patches
from lctrain.tracing.patches import patched

PHASES = ("forward", "backward", "optimizer")

# Ops that hand tensors to a process group: functional collectives (DTensor) and the c10d ops
# behind torch.distributed's collectives (context-parallel attention).
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")

SETTLE_SECONDS = 10.0
"""How long `settle` waits for a process group to let go of the tensors it was given."""


def holding_tensor(t):
    """The tensor holding the memory: a DTensor's local shard, an async collective's result."""
    t = getattr(t, "_local_tensor", t)
    return getattr(t, "elem", t)


def storage_of(t: Tensor):
    return holding_tensor(t).untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Bytes alive in the storages ops create while active, on top of `state` (bytes that exist
    before); `exclude`: ids of storages never counted (e.g. parameters); `host`: ids of storages
    in host memory (offloaded state), not counted either. With `views`, a storage made before
    is counted too while a view of it that an op made here is alive (e.g. the micro-batch's
    labels, whose view the loss keeps for the backward)."""

    def __init__(self, state: int = 0, exclude: set[int] | None = None,
                 host: set[int] | None = None, views: bool = False):
        super().__init__()
        self.state, self.exclude, self.host = state, exclude or set(), host or set()
        self.views = views
        self._viewed: dict[int, int] = {}  # id(storage) made before -> views of it alive
        self.where = "other"
        # id(storage) -> [bytes, phase, op index made, op, where, (dtype, shape) made as]
        self.live: dict[int, list] = {}
        self.by_phase = dict.fromkeys(PHASES, 0)
        self.in_optimizer = False
        self.ops, self.micro_step = 0, 0
        self.peak, self.peak_op, self.at_peak = state, -1, dict(self.by_phase)
        self.peak_where = ("before the step", 0, "")
        self.peak_live: dict[int, list] = {}
        self._handed: list[weakref.ref] = []  # tensors a process group was given
        self._patches = contextlib.ExitStack()

    def __enter__(self):
        tracker = self

        def resizing(original):
            def resize_(storage, size):
                out = original(storage, size)
                tracker._resized(storage)
                return out
            return resize_

        self._patches.enter_context(patched({
            patches.STORAGE_RESIZE: resizing,
            patches.PROFILER_ENTER: lambda original: lambda self: self,
            patches.PROFILER_EXIT: lambda original: lambda self, *exc: None}))
        return super().__enter__()

    def __exit__(self, *exc):
        self._patches.close()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
            out = self._collective(func, args, kwargs)
        else:
            out = self.run(func, args, kwargs)
        self.ops += 1
        # an op's new storages: not its inputs' (views, in-place results), told apart by the
        # C++ storage, which several Python wrappers of one view may share
        inputs = {storage_of(t)._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor) or t.is_meta:
                continue
            if storage_of(t)._cdata not in inputs:
                self._track(t, func)
            elif self.views:
                self._view(t, func)
        self._update_peak(func)
        return out

    def run(self, func, args, kwargs):
        """The op itself (a subclass checks or replaces some)."""
        return func(*args, **kwargs)

    def _collective(self, func, args, kwargs):
        """Run a collective so that the process group holds none of the tensor objects the
        program holds, and note the ones it does hold. A gloo Work keeps the tensors it was
        given (input and output) until its worker thread drops the Work, which it does after
        the Work signalled completion: wait() returns first and the release follows later
        (microseconds to milliseconds: that thread must be scheduled and take the GIL). The
        collective gets aliases of its tensor arguments (new tensor objects on the same storage:
        wait_tensor's work registry is keyed by storage) and `settle` waits until the process
        group has dropped those of torch.distributed's collectives (a functional collective's
        Work holds them until wait_tensor is called, perhaps in the backward)."""
        originals: dict[int, Tensor] = {}

        def hide(t):
            if type(t) is not Tensor:
                return t
            alias = torch.ops.aten.alias.default(t)
            originals[id(alias)] = t
            if func.namespace == "c10d":  # (a functional one's Work waits for wait_tensor)
                self._handed.append(weakref.ref(alias))
            return alias

        def back(t):  # an argument returned (in-place collectives, wait_tensor) as the original
            return originals.get(id(t), t)

        args, kwargs = tree_map(hide, (args, kwargs))
        return tree_map(back, self.run(func, args, kwargs))

    def settle(self, seconds: float = SETTLE_SECONDS) -> None:
        """Wait until the process groups have let go of every tensor they were given, so that
        what is alive now is what the program holds. Raises if one is still held after
        `seconds` (a collective never waited for)."""
        deadline = time.monotonic() + seconds
        while True:
            self._handed = [r for r in self._handed if r() is not None]
            if not self._handed:
                return
            if time.monotonic() > deadline:
                held = [tuple(t.shape) for r in self._handed if (t := r()) is not None]
                raise RuntimeError(f"a process group still holds {len(held)} tensors "
                                   f"{seconds:.0f} s after the last collective (shapes {held}): "
                                   "a collective whose Work was never waited for")
            time.sleep(0.0002)  # the worker thread needs the GIL to drop them

    def phase(self) -> str:
        if self.in_optimizer:
            return "optimizer"
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def _track(self, t: Tensor, func) -> None:
        storage = storage_of(t)
        key = id(storage)
        if key in self.live or key in self.host or key in self.exclude:
            return
        phase = self.phase()
        self.live[key] = [storage.nbytes(), phase, self.ops, func, self.where,
                          (t.dtype, tuple(t.shape))]
        self.by_phase[phase] += storage.nbytes()
        weakref.finalize(storage, self._freed, key)

    def _view(self, t: Tensor, func) -> None:
        """`t` views an input's storage: one made before is counted while such views live."""
        key = id(storage_of(t))
        if key in self.live and key not in self._viewed:  # made here: counted already
            return
        if key not in self._viewed:
            self._track(t, func)
            if key not in self.live:  # excluded, or on the host
                return
            self._viewed[key] = 0
        self._viewed[key] += 1
        weakref.finalize(holding_tensor(t), self._view_gone, key)

    def _view_gone(self, key: int) -> None:
        self._viewed[key] -= 1
        if not self._viewed[key]:
            del self._viewed[key]
            self._freed(key)

    def _freed(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is None:  # a host storage
            self.host.discard(key)
            return
        self.by_phase[entry[1]] -= entry[0]
        self.freed(key)

    def freed(self, key: int) -> None:
        """A counted storage went (a subclass notes some)."""

    def _resized(self, storage) -> None:
        entry = self.live.get(id(storage))
        if entry is not None:
            self.by_phase[entry[1]] += storage.nbytes() - entry[0]
            entry[0] = storage.nbytes()
            self._update_peak("a storage resized")

    def _update_peak(self, func) -> None:
        total = self.state + sum(self.by_phase.values())
        if total > self.peak:
            self.peak, self.peak_op, self.at_peak = total, self.ops, dict(self.by_phase)
            self.peak_where = (self.phase(), self.micro_step, func)
            # (a copy first: a process group's thread may free a storage meanwhile)
            self.peak_live = {k: v[:] for k, v in self.live.copy().items()}

    def claim(self, where: str, tensor) -> None:
        """Label the storage of `tensor` (alive now) `where`, whoever created it."""
        tensor = holding_tensor(tensor)
        if isinstance(tensor, Tensor):
            entry = self.live.get(id(tensor.untyped_storage()))
            if entry is not None:
                entry[4] = where

    def alive(self, leave_out: set[int] = frozenset()) -> list[tuple]:
        """(where, op, dtype, shape, bytes) of each storage alive now and not empty, those in
        `leave_out` left out."""
        # a copy first: a process group's worker thread may drop a storage (and run its
        # weakref callback) while this reads
        return [(where, str(func), *made_as, nbytes)
                for key, (nbytes, _, _, func, where, made_as) in self.live.copy().items()
                if nbytes and key not in leave_out]

    def alive_by_where(self, leave_out: set[int] = frozenset()) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for row in self.alive(leave_out):
            out[row[0]] += row[-1]
        return dict(out)

    def largest_at_peak(self, n: int = 8) -> list[dict]:
        """The `n` largest storages made and still held at the peak."""
        rows = sorted(self.peak_live.values(), key=lambda e: -e[0])[:n]
        return [{"bytes": e[0], "phase": e[1], "op": str(e[3])} for e in rows]

    def on_host(self, storage) -> None:
        """`storage` (made while active) lives in host memory: no longer counted."""
        entry = self.live.pop(id(storage), None)
        if entry is not None:
            self.by_phase[entry[1]] -= entry[0]
        self.host.add(id(storage))
