"""Collectives with traffic accounting (context parallelism's, and DTensor's on request); the
group is always an argument.

Traffic is counted as elements (and bytes) *sent by this rank* (docs/parallelism.md §0):
an all-to-all sends (P-1)/P of its input (1/P stays local), an all-gather sends its local block to
P-1 peers in a ring, a reduce-scatter sends (P-1)/P of its input, a P2P send sends its tensor.
Counting is active only inside `record_traffic()`; each entry is keyed by (tag, collective), the
tag naming the algorithm (`traffic_tag("ring")`). Only the collectives of this module are counted
(context-parallel attention); FSDP/DDP gradient traffic is not. The training loop logs the bytes
each step sent as `traffic/cp` (and `cp_bytes_sent`) in metrics.jsonl, and the other groups'
traffic from the formulas of `lctrain.planning.traffic` (docs/parallelism.md §14).

A collective that the group's backend cannot run on its tensors' device (gloo with CUDA tensors:
several ranks checking on one GPU) is staged through host memory and counted exactly as if it
had not been (docs/parallelism.md §20).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_recorder: ContextVar[TrafficRecorder | None] = ContextVar("lctrain_traffic", default=None)
_tag: ContextVar[str] = ContextVar("lctrain_traffic_tag", default="other")
_force_staging: ContextVar[bool] = ContextVar("lctrain_force_host_staging", default=False)

GLOO_CUDA_OPS = frozenset({"broadcast", "all_reduce"})
"""The collectives gloo runs on CUDA tensors itself: the rows of torch's backend table (the
"Backends" section of torch.distributed's documentation) marked for gloo on GPU in every version
of it lctrain supports. Later versions mark more rows (all_gather, reduce_scatter, then
all_to_all), earlier ones do not, and send/recv never; staging is correct either way, so the
rows all versions agree on decide. docs/parallelism.md §20."""


@dataclass
class TrafficRecorder:
    elements: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    to_peer: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Elements sent point to point, by destination (global rank)."""

    def add(self, op: str, elements: int, itemsize: int, peer: int | None = None) -> None:
        key = (_tag.get(), op)
        self.elements[key] += elements
        self.bytes[key] += elements * itemsize
        if peer is not None:
            self.to_peer[peer] += elements

    def total(self, tag: str | None = None, op: str | None = None) -> int:
        return sum(v for (t, o), v in self.elements.items()
                   if (tag is None or t == tag) and (op is None or o == op))


@contextlib.contextmanager
def record_traffic():
    """Count elements sent by this rank's collectives inside the block."""
    rec = TrafficRecorder()
    token = _recorder.set(rec)
    try:
        yield rec
    finally:
        _recorder.reset(token)


@contextlib.contextmanager
def traffic_tag(tag: str):
    token = _tag.set(tag)
    try:
        yield
    finally:
        _tag.reset(token)


def current_tag() -> str:
    """The traffic tag in force; autograd functions keep it for their backward."""
    return _tag.get()


def _count(op: str, elements: int, t: Tensor, peer: int | None = None) -> None:
    rec = _recorder.get()
    if rec is not None:
        rec.add(op, elements, t.element_size(), peer)


def needs_host_staging(device: torch.device, group: dist.ProcessGroup, op: str) -> bool:
    """True when `op` on tensors on `device` must go through host memory: the device is not the
    CPU, the group serves it with gloo (also when CUDA is one entry of a mixed backend such as
    `cpu:gloo,cuda:gloo`; `cpu:gloo,cuda:nccl` sends CUDA to NCCL, so no), and gloo does not run
    `op` on it (`GLOO_CUDA_OPS`). Inside `force_host_staging()`, always."""
    if _force_staging.get():
        return True
    if device.type == "cpu" or op in GLOO_CUDA_OPS:
        return False
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # no backend for the device: the collective raises torch's own error
        return False
    return backend.name() == dist.Backend.GLOO


@contextlib.contextmanager
def force_host_staging():
    """Inside the block every collective of this module is staged through host memory, whatever
    its device and backend (tests: the staged path on the CPU, where it copies CPU to CPU)."""
    token = _force_staging.set(True)
    try:
        yield
    finally:
        _force_staging.reset(token)


def _staged(x: Tensor, group: dist.ProcessGroup,
            op: str) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """(the tensor `op` runs on, a function that brings a result back to x's device): a host
    copy and a copy back when `needs_host_staging`, else x itself and the identity. Traffic is
    counted on x by the caller: a host copy is not network traffic."""
    if not needs_host_staging(x.device, group, op):
        return x, lambda y: y
    device = x.device
    return x.to("cpu", copy=True), lambda y: y.to(device, copy=True)


def all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split x into P pieces along scatter_dim, send piece j to rank j, concatenate what arrives
    along gather_dim in source-rank order. Ulysses: [B, S/P, H, d] -> [B, S, H/P, d] with
    scatter_dim=2, gather_dim=1."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    pieces, back = _staged(_as_pieces(x, p, scatter_dim), group, "all_to_all")  # [P, ...piece]
    out = torch.empty_like(pieces)
    dist.all_to_all_single(out, pieces, group=group)
    _count("all_to_all", x.numel() * (p - 1) // p, x)
    del pieces  # a staging copy is freed before the output is assembled
    return _from_pieces(back(out), gather_dim)


def _as_pieces(x: Tensor, p: int, dim: int) -> Tensor:
    """x split into p pieces along dim, stacked [P, ...piece]: a view of x when the dims before
    `dim` have size 1 (the pieces are then consecutive blocks of memory), else one copy."""
    if x.is_contiguous() and math.prod(x.shape[:dim]) == 1:
        return x.view(p, *x.shape[:dim], x.shape[dim] // p, *x.shape[dim + 1:])
    return torch.stack(x.chunk(p, dim=dim))


def _from_pieces(out: Tensor, dim: int) -> Tensor:
    """The P received pieces [P, ...piece] concatenated along dim: a view when the dims before
    `dim` have size 1 (source-rank order is memory order), else one copy."""
    piece = out.shape[1:]
    if math.prod(piece[:dim]) == 1:
        return out.view(*piece[:dim], out.shape[0] * piece[dim], *piece[dim + 1:])
    return torch.cat(out.unbind(0), dim=dim)


class _Reversed(torch.autograd.Function):
    """A collective `fn(x, *forward_args)` whose backward is the same collective sending the
    gradient back the way x came, `fn(grad, *backward_args)`, under the forward's traffic tag."""

    @staticmethod
    def forward(ctx, x, fn, forward_args, backward_args):
        ctx.fn, ctx.backward_args, ctx.tag = fn, backward_args, current_tag()
        return fn(x, *forward_args)

    @staticmethod
    def backward(ctx, grad):
        with traffic_tag(ctx.tag):
            grad = ctx.fn(grad.contiguous(), *ctx.backward_args)
        return grad, None, None, None


def all_to_all_autograd(x: Tensor, group: dist.ProcessGroup, scatter_dim: int,
                        gather_dim: int) -> Tensor:
    """`all_to_all` whose backward is the inverse all-to-all (Ulysses, docs/parallelism.md §5)."""
    return _Reversed.apply(x, all_to_all, (group, scatter_dim, gather_dim),
                           (group, gather_dim, scatter_dim))


def all_to_all_rows(x: Tensor, group: dist.ProcessGroup, send: list[int],
                    receive: list[int]) -> Tensor:
    """Rows of x [N, ...] in runs of `send[j]` rows sent to rank j of the group, in rank order;
    returns the `receive[j]` rows from each rank j, concatenated in rank order (uneven splits:
    the experts' dispatch and combine, docs/parallelism.md §28)."""
    local, back = _staged(x.contiguous(), group, "all_to_all")
    out = local.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, local, output_split_sizes=receive, input_split_sizes=send,
                           group=group)
    me = dist.get_rank(group)
    _count("all_to_all", (x.shape[0] - send[me]) * math.prod(x.shape[1:]), x)
    return back(out)


def all_to_all_rows_autograd(x: Tensor, group: dist.ProcessGroup, send: list[int],
                             receive: list[int]) -> Tensor:
    """`all_to_all_rows` whose backward sends the gradients back the way the rows came."""
    return _Reversed.apply(x, all_to_all_rows, (group, send, receive), (group, receive, send))


class _SumPassingGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        local, back = _staged(x.clone(), group, "all_reduce")
        dist.all_reduce(local, group=group)
        return back(local)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_passing_grad(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of every rank's x, whose gradient reaches x unchanged: for a value every rank of
    the group computes alike from the sum, each rank back-propagating its own part (a mixture of
    experts' router statistics under context parallelism, docs/parallelism.md §28). Not counted
    as traffic (a few floats per micro-step)."""
    return _SumPassingGrad.apply(x, group)


def all_gather(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """Concatenation along dim of every rank's x, in group-rank order."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    local, back = _staged(x.contiguous(), group, "all_gather")
    out = local.new_empty((p * x.shape[0], *x.shape[1:]))
    # the name torch 2.13 prefers, else the one every torch since 1.13 has
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, local, group=group)
    _count("all_gather", x.numel() * (p - 1), x)
    return torch.cat(back(out).chunk(p, dim=0), dim=dim)


def reduce_scatter(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """Sum over ranks of x, of which this rank keeps its 1/P slice along dim."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    pieces = torch.cat(x.chunk(p, dim=dim), dim=0).contiguous()  # [P * B, ...] piece j for rank j
    pieces, back = _staged(pieces, group, "reduce_scatter")
    out = pieces.new_empty((pieces.shape[0] // p, *pieces.shape[1:]))
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, pieces, group=group)
    _count("reduce_scatter", x.numel() * (p - 1) // p, x)
    return back(out)


class RingExchange:
    """Send tensors to the next rank of the group and receive the same shapes from the previous
    one, asynchronously (batch_isend_irecv), so compute can overlap the transfer. Staged through
    host memory (`needs_host_staging`: gloo sends no CUDA tensor), the receive buffers are on the
    host and `wait` returns them moved to the device."""

    def __init__(self, group: dist.ProcessGroup, tag: int = 0):
        self.group, self.tag = group, tag
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)
        self._reqs: list = []
        self._send: list[Tensor] = []
        self._recv: list[tuple[Tensor, Callable[[Tensor], Tensor]]] = []

    def start(self, tensors: list[Tensor]) -> None:
        assert not self._reqs, "previous exchange not waited for"
        ops, self._send, self._recv = [], [], []
        for t in tensors:
            send, back = _staged(t.contiguous(), self.group, "send")  # send, recv: one answer
            recv = torch.empty_like(send)
            self._send.append(send)  # kept alive until wait()
            self._recv.append((recv, back))
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group, self.tag))
            ops.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, self.tag))
            _count("p2p", t.numel(), t, self.next)
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for req in self._reqs:
            req.wait()
        self._reqs, self._send = [], []
        return [back(recv) for recv, back in self._recv]


class PeerExchange:
    """Send tensors to some ranks of the group and receive tensors from some, all at once and
    asynchronously (batch_isend_irecv): the halo exchange of window layers, where each rank
    talks only to the ranks whose tokens lie within the window. Every rank knows the shapes it
    sends and receives (both sides plan them from the same positions). Staged through host
    memory like `RingExchange`."""

    def __init__(self, group: dist.ProcessGroup, tag: int = 0):
        self.group, self.tag = group, tag
        self._reqs: list = []
        self._send: list[Tensor] = []
        self._recv: dict[int, list[tuple[Tensor, Callable[[Tensor], Tensor]]]] = {}

    def start(self, send: dict[int, list[Tensor]], recv: dict[int, list[torch.Size]],
              like: Tensor) -> None:
        """send[peer]: tensors for that group rank; recv[peer]: the shapes that arrive from it
        (dtype and device of `like`)."""
        assert not self._reqs, "previous exchange not waited for"
        ops, self._send, self._recv = [], [], {}
        for peer, tensors in send.items():
            for t in tensors:
                staged, _ = _staged(t.contiguous(), self.group, "send")
                self._send.append(staged)  # kept alive until wait()
                to = dist.get_global_rank(self.group, peer)
                ops.append(dist.P2POp(dist.isend, staged, to, self.group, self.tag))
                _count("p2p", t.numel(), t, to)
        for peer, shapes in recv.items():
            for shape in shapes:
                buf, back = _staged(like.new_empty(0), self.group, "recv")
                buf = buf.new_empty(shape)
                self._recv.setdefault(peer, []).append((buf, back))
                ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(self.group, peer),
                                      self.group, self.tag))
        self._reqs = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> dict[int, list[Tensor]]:
        """What arrived, by sending group rank, on `like`'s device."""
        for req in self._reqs:
            req.wait()
        self._reqs, self._send = [], []
        return {peer: [back(buf) for buf, back in got] for peer, got in self._recv.items()}


class _FunctionalCollectives(TorchDispatchMode):
    """Counts the functional collectives that DTensor (TP/SP) issues, like `_count` does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name == "all_gather_into_tensor":
            _count("all_gather", args[0].numel() * (args[1] - 1), args[0])
        elif name == "reduce_scatter_tensor":
            _count("reduce_scatter", args[0].numel() * (args[2] - 1) // args[2], args[0])
        elif name == "all_reduce":
            p = _resolve_process_group(args[2]).size()
            _count("all_reduce", 2 * args[0].numel() * (p - 1) // p, args[0])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_dtensor_traffic():
    """Like `record_traffic`, for the collectives DTensor issues (TP/SP); slower: tests, benches."""
    with record_traffic() as rec, _FunctionalCollectives():
        yield rec


def _process_groups(args) -> list:
    """The process groups a dispatched collective op names (boxed, or by name)."""
    out = []
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith(
                "c10d.ProcessGroup"):
            out.append(dist.ProcessGroup.unbox(a))
        elif isinstance(a, str):
            try:
                out.append(_resolve_process_group(a))
            except (ValueError, RuntimeError, KeyError):  # a string that names no group
                continue
    return out


class _DeviceCheck(TorchDispatchMode):
    """Raises when a collective gets a tensor on a device its process group has no backend for
    (a CPU tensor on an NCCL group fails, or hangs, only at run time on a GPU cluster)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) in ("c10d", "_c10d_functional"):
            groups = _process_groups(tree_flatten((args, kwargs))[0])
            for t in tree_flatten((args, kwargs))[0]:
                t = getattr(t, "_local_tensor", t)
                for pg in groups if isinstance(t, Tensor) else ():
                    if t.device.type not in {d.type for d in pg._device_types}:
                        raise RuntimeError(
                            f"{func} got a tensor on {t.device}, but its process group runs on "
                            f"{', '.join(sorted({d.type for d in pg._device_types}))}; create "
                            "the tensor on the runtime's device (rt.device)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def check_collective_devices():
    """Inside the block, every collective checks that its tensors are on a device its process
    group serves (tests, and the GPU check script around a training step and the evals)."""
    with _DeviceCheck():
        yield
