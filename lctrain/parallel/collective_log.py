"""Every collective and point-to-point call a rank issues, recorded in order, and the check that
the ranks of each process group issue matching sequences (docs/parallelism.md §30).

NCCL (like gloo) pairs the calls of a group's ranks by their order alone: a rank that issues one
collective more, or another op, or a different shape, than the others of its group hangs or
corrupts the step, and a send without the receive it meets hangs. Every such call reaches
torch's dispatcher as a `c10d` op (the `torch.distributed` API, FSDP2, the pipeline schedules,
lctrain's own comm) or a `_c10d_functional` op (DTensor, functional collectives), so one
dispatch mode sees them all, on real gloo ranks and in a trace alike.

`CollectiveLog` records each as a `Call`: the op, its group as global ranks, the shapes and
dtype of what it sends, and for a send or receive the peer. `mismatches` takes every rank's log
and names each disagreement: within a group, the n-th collective of every member must be the
same op on the same dtype and (but for the all-to-all, whose splits are each rank's own) the
same shapes; between two ranks, the n-th send from a to b must meet the n-th receive at b from
a, of the same shape and dtype; and where a group's first call is a batch of sends and receives,
every member must take part in it (NCCL's rule for a communicator made by its first call).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

UNEVEN = {"alltoall_base_", "all_to_all_single"}
"""Ops whose shapes differ between ranks by design (each rank's own split sizes)."""
P2P = {"send", "recv_", "recv_any_source_"}
SKIPPED = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}
"""Ops that move no data of the step (a wait; a barrier is matched by its group anyway)."""


@dataclass(frozen=True)
class Call:
    """One collective or point-to-point call of one rank."""

    op: str
    """The c10d op's name (allreduce_, _allgather_base_, alltoall_base_, send, recv_, ...; a
    functional collective's: all_reduce, all_gather_into_tensor, ...)."""
    group: tuple[int, ...]
    """The global ranks of its process group."""
    group_name: str
    """Its process group's name: two groups of the same ranks are two communicators."""
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    peer: int | None = None
    """The global rank a send goes to or a receive comes from."""

    def __str__(self) -> str:
        shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.shapes)
        peer = "" if self.peer is None else f" peer {self.peer}"
        return f"{self.op}[{shapes}] {self.dtype}{peer}"


def _group_of(args) -> dist.ProcessGroup | None:
    """The process group among a c10d op's arguments (a boxed ProcessGroup), or a functional
    collective's (its group name, a string, last)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            return dist.ProcessGroup.unbox(a)
    for a in reversed(args):
        if isinstance(a, str):
            try:
                return distributed_c10d._resolve_process_group(a)
            except (KeyError, RuntimeError, ValueError):
                continue
    return None


def _sent(name: str, args) -> list[Tensor]:
    """The tensors a call sends (its input): the first tensor argument, or for the ops that
    take (output, input) the second."""
    tensors = [t for t in tree_flatten(list(args))[0] if isinstance(t, Tensor)]
    takes_output_first = name in ("_allgather_base_", "_reduce_scatter_base_", "alltoall_base_",
                                  "allgather_into_tensor_coalesced_",
                                  "reduce_scatter_tensor_coalesced_")
    if takes_output_first and len(tensors) > 1:
        return tensors[len(tensors) // 2:]
    return tensors


class CollectiveLog(TorchDispatchMode):
    """Inside the block, every collective and point-to-point call of this rank, in order
    (`calls`)."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        name = func._opname
        if namespace in ("c10d", "_c10d_functional") and name not in SKIPPED:
            pg = _group_of(args)
            if pg is not None:
                ranks = tuple(dist.get_process_group_ranks(pg))
                sent = _sent(name, args)
                peer = None
                if name in P2P:  # (tensors, group, peer rank inside the group, tag)
                    peer = ranks[next(a for a in args if isinstance(a, int))]
                self.calls.append(Call(name, ranks, pg.group_name,
                                       tuple(tuple(t.shape) for t in sent),
                                       str(sent[0].dtype) if sent else "-", peer))
        return func(*args, **(kwargs or {}))


def mismatches(logs: dict[int, list[Call]]) -> list[str]:
    """Every disagreement between the ranks' logs (global rank -> its calls in order), as
    sentences; empty when each group's ranks issue matching sequences, every send meets its
    receive, and each group begun by point-to-point calls has every member in them."""
    problems = []
    by_group: dict[tuple[str, tuple[int, ...]], dict[int, list[Call]]] = defaultdict(dict)
    for rank, calls in logs.items():
        for call in calls:
            if call.op not in P2P:
                by_group[(call.group_name, call.group)].setdefault(rank, []).append(call)
    for (_, group), members in sorted(by_group.items()):
        problems += _group_problems(group, members, logs)
    problems += _p2p_problems(logs)
    problems += _first_call_problems(logs)
    return problems


def _group_problems(group: tuple[int, ...], members: dict[int, list[Call]],
                    logs: dict[int, list[Call]]) -> list[str]:
    seqs = {rank: members.get(rank, []) for rank in group if rank in logs}
    lengths = {rank: len(s) for rank, s in seqs.items()}
    problems = []
    if len(set(lengths.values())) > 1:
        problems.append(f"group {group}: its ranks issue different numbers of collectives "
                        f"({', '.join(f'rank {r}: {n}' for r, n in lengths.items())})")
    for i in range(min(lengths.values(), default=0)):
        calls = {rank: s[i] for rank, s in seqs.items()}
        first = next(iter(calls.values()))
        same = all(c.op == first.op and c.dtype == first.dtype
                   and (c.op in UNEVEN or c.shapes == first.shapes) for c in calls.values())
        if not same:
            problems.append(f"group {group}, collective {i}: " + "; ".join(
                f"rank {r} {c}" for r, c in calls.items()))
            break  # the rest of the sequence is out of step
    return problems


def _p2p_problems(logs: dict[int, list[Call]]) -> list[str]:
    sends: dict[tuple[int, int], list[Call]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Call]] = defaultdict(list)
    for rank, calls in logs.items():
        for c in calls:
            if c.op == "send":
                sends[(rank, c.peer)].append(c)
            elif c.op in P2P:
                recvs[(c.peer, rank)].append(c)
    problems = []
    for pair in sorted(set(sends) | set(recvs)):
        if pair[0] not in logs or pair[1] not in logs:
            continue
        s, r = sends.get(pair, []), recvs.get(pair, [])
        if len(s) != len(r):
            problems.append(f"rank {pair[0]} sends {len(s)} times to rank {pair[1]}, which "
                            f"receives {len(r)} times from it")
        for i, (a, b) in enumerate(zip(s, r)):
            if a.shapes != b.shapes or a.dtype != b.dtype:
                problems.append(f"send {i} from rank {pair[0]} to rank {pair[1]}: {a}, "
                                f"received as {b}")
                break
    return problems


def _first_call_problems(logs: dict[int, list[Call]]) -> list[str]:
    """Groups whose first call is a batch of sends and receives that not every member joins."""
    first: dict[tuple[str, tuple[int, ...]], dict[int, Call]] = defaultdict(dict)
    for rank, calls in logs.items():
        for c in calls:
            first[(c.group_name, c.group)].setdefault(rank, c)
    problems = []
    for (_, group), calls in sorted(first.items()):
        present = [r for r in group if r in logs]
        p2p_first = [r for r in present if r in calls and calls[r].op in P2P]
        if p2p_first and len(p2p_first) != len(present):
            problems.append(f"group {group} begins with sends and receives on ranks {p2p_first} "
                            f"only: NCCL makes a communicator at its first call, which every "
                            f"member must join")
    return problems
