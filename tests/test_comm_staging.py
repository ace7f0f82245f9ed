"""Collectives staged through host memory (docs/parallelism.md §20) against the same collectives
unstaged, on gloo ranks.

On the CPU no tensor needs staging, so `force_host_staging()` sends every collective through the
staging path (its copies are CPU to CPU) and the real gloo collectives run on the copies. Results
must be bitwise those of the unstaged path, and the traffic counted (elements and bytes) exactly
the same: a host copy is not network traffic. The staging decision is checked on real process
groups; only a backend that is not built here (NCCL) is faked, and only for the lookup.
"""

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist

from lctrain.attention import ContextParallelAttention
from lctrain.comm import (
    GLOO_CUDA_OPS,
    RingExchange,
    _staged,
    all_gather,
    all_to_all,
    force_host_staging,
    needs_host_staging,
    record_traffic,
    reduce_scatter,
)
from lctrain.layout import sequence
from tests.helpers import on_ranks
from tests.test_attention_cp import cp_groups, doc_ids_from_lengths

CUDA = torch.device("cuda")  # a device object only: nothing here allocates on it
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def run(fn, args: tuple, staged: bool):
    """(fn(*args), the elements and bytes counted), staged through the host or not."""
    with record_traffic() as rec, (force_host_staging() if staged else contextlib.nullcontext()):
        result = fn(*args)
    return result, (dict(rec.elements), dict(rec.bytes))


def assert_same(what: str, fn, *args):
    """fn(*args) staged and unstaged: bitwise equal results and identical traffic; returns the
    unstaged result and traffic."""
    plain, plain_traffic = run(fn, args, staged=False)
    host, host_traffic = run(fn, args, staged=True)
    for a, b in zip(as_list(plain), as_list(host), strict=True):
        assert a.device == b.device and a.dtype == b.dtype, what
        assert torch.equal(a, b), what
    assert host_traffic == plain_traffic, (what, host_traffic, plain_traffic)
    return plain, plain_traffic


def as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def check_collectives() -> int:
    p, rank = dist.get_world_size(), dist.get_rank()
    group, checks = dist.group.WORLD, 0
    gen = torch.Generator().manual_seed(p)
    for dtype, batch in itertools.product((torch.float32, torch.bfloat16), (1, 2)):
        # Ulysses' all-to-all [B, S/P, H, d] -> [B, S, H/P, d]; batch 1 takes the view path
        full = torch.randn(batch, 3 * p, 2 * p, 5, generator=gen).to(dtype)
        local = full.chunk(p, dim=1)[rank]
        out, (elements, nbytes) = assert_same(f"all_to_all {dtype} B={batch}", all_to_all,
                                              local, group, 2, 1)
        assert torch.equal(out, full.chunk(p, dim=2)[rank])
        assert sum(elements.values()) == local.numel() * (p - 1) // p
        assert sum(nbytes.values()) == sum(elements.values()) * local.element_size()
        # ...and back (its backward)
        back, _ = assert_same(f"all_to_all back {dtype}", all_to_all, out, group, 1, 2)
        assert torch.equal(back, local)
        # all-gather along the sequence, reduce-scatter of its gradient
        gathered, (elements, _) = assert_same(f"all_gather {dtype} B={batch}", all_gather,
                                              local, group, 1)
        assert torch.equal(gathered, full)
        assert sum(elements.values()) == local.numel() * (p - 1)
        grads = [torch.randn(full.shape, generator=gen).to(dtype) for _ in range(p)]
        reduced, (elements, _) = assert_same(f"reduce_scatter {dtype} B={batch}", reduce_scatter,
                                             grads[rank], group, 1)
        want = sum(g.double() for g in grads).chunk(p, dim=1)[rank]  # gloo's order of sums
        torch.testing.assert_close(reduced.double(), want, **TOL[dtype])
        assert sum(elements.values()) == full.numel() * (p - 1) // p
        # the ring: two tensors (K and V) to the next rank, from the previous one
        kv = [full * (rank + 1), full[..., :3].contiguous() + rank]
        prev = (rank - 1) % p
        got, (elements, _) = assert_same(f"ring {dtype} B={batch}", ring_exchange, kv, group)
        assert torch.equal(got[0], full * (prev + 1)) and torch.equal(got[1], full[..., :3] + prev)
        assert sum(elements.values()) == sum(t.numel() for t in kv)
        checks += 5
    return checks


def ring_exchange(tensors: list, group) -> list:
    exchange = RingExchange(group, tag=5)
    exchange.start(tensors)
    return exchange.wait()


def attention_step(algo: str, g, qkv: list, dout, docs) -> list:
    """Forward and backward of one context-parallel attention: [out, lse, dq, dk, dv]."""
    S = qkv[0].shape[1]

    def local(x):
        return sequence.split(x, 1, g.cp_rank, g.cp_size, "zigzag")

    ins = [local(x).requires_grad_() for x in qkv]
    out, lse = ContextParallelAttention(algo, g, S, "zigzag", causal=True).attention(*ins, docs)
    out.backward(local(dout))
    return [out.detach(), lse, *(x.grad for x in ins)]


def check_staging_helper() -> int:
    """Inside force_host_staging the helper really copies, both ways; outside it, on the CPU,
    it hands the tensor itself back."""
    x = torch.arange(6.0)
    same, identity = _staged(x, dist.group.WORLD, "send")
    assert same is x and identity(x) is x
    with force_host_staging():
        host, back = _staged(x, dist.group.WORLD, "send")
    assert host.data_ptr() != x.data_ptr() and torch.equal(host, x)
    moved = back(host)
    assert moved.data_ptr() != host.data_ptr() and moved.device == x.device
    return 1


def check_decision_on_real_groups() -> int:
    """The decision, asked of real gloo groups: `gloo` serves every device it knows (CUDA among
    them, also in a CPU-only build), `cpu:gloo` the CPU only."""
    world = dist.group.WORLD
    assert dist.get_backend(world) == "gloo"
    assert needs_host_staging(CUDA, world, "all_to_all")
    assert needs_host_staging(CUDA, world, "send")
    assert needs_host_staging(CUDA, world, "all_gather")  # not in every version of the table
    assert not needs_host_staging(CUDA, world, "all_reduce")  # gloo runs it on CUDA itself
    assert not needs_host_staging(torch.device("cpu"), world, "send")
    cpu_only = dist.new_group(backend="cpu:gloo")
    assert not needs_host_staging(CUDA, cpu_only, "send")  # no CUDA backend: torch's own error
    with force_host_staging():
        assert needs_host_staging(torch.device("cpu"), world, "all_gather")
    return 1


def check_attention() -> int:
    """One case per algorithm, forward and backward, staged and unstaged: the same outputs, lse,
    gradients and traffic (bf16 for the ring: its dK/dV accumulators travel in float32)."""
    world = dist.get_world_size()
    layouts = [("ring", world, 1), ("ulysses", 1, world), ("allgather", world, 1)]
    if world >= 4:
        layouts.append(("usp", world // 2, 2))
    cache: dict = {}
    B, S, H, Hkv, hd = 2, 8 * world, 2 * world, world, 8
    for algo, ring, uly in layouts:
        dtype = torch.bfloat16 if algo == "ring" else torch.float32
        g = cp_groups(world, ring, uly, cache)
        gen = torch.Generator().manual_seed(len(algo))
        q, dout = (torch.randn(B, S, H, hd, generator=gen).to(dtype) for _ in range(2))
        k, v = (torch.randn(B, S, Hkv, hd, generator=gen).to(dtype) for _ in range(2))
        docs = doc_ids_from_lengths([5, S - 9, 4], B)
        _, (elements, _) = assert_same(f"attention {algo}", attention_step, algo, g, [q, k, v],
                                       dout, docs)
        assert sum(elements.values()) > 0, algo
    return len(layouts)


def checks_on_rank() -> int:
    return (check_collectives() + check_staging_helper() + check_decision_on_real_groups()
            + check_attention())


@pytest.mark.parametrize("world", [2, 4])
def test_staged_collectives_match_unstaged(world):
    counts = on_ranks(checks_on_rank, world, timeout_s=120)
    assert counts == [counts[0]] * world and counts[0] >= 20


class _FakeBackend:
    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name


class _FakeGroup:
    """Stands in for the backend lookup of a ProcessGroup only: `cpu:gloo,cuda:nccl` cannot be
    built without NCCL."""

    def __init__(self, backends: dict[str, str]):
        self.backends = backends

    def _get_backend(self, device: torch.device) -> _FakeBackend:
        if device.type not in self.backends:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return _FakeBackend(self.backends[device.type])


def test_staging_decision_follows_the_backend_of_the_device():
    mixed = _FakeGroup({"cpu": "gloo", "cuda": "nccl"})
    gloo_everywhere = _FakeGroup({"cpu": "gloo", "cuda": "gloo"})
    cpu_only = _FakeGroup({"cpu": "gloo"})
    for op in ("all_to_all", "send", "all_gather", "reduce_scatter"):
        assert not needs_host_staging(CUDA, mixed, op)  # CUDA goes to NCCL
        assert needs_host_staging(CUDA, gloo_everywhere, op)
        assert not needs_host_staging(CUDA, cpu_only, op)  # torch raises its own error
        assert not needs_host_staging(torch.device("cpu"), gloo_everywhere, op)
    for op in GLOO_CUDA_OPS:
        assert not needs_host_staging(CUDA, gloo_everywhere, op)
    with force_host_staging():
        assert needs_host_staging(torch.device("cpu"), mixed, "all_gather")
    assert not needs_host_staging(torch.device("cpu"), mixed, "all_gather")
    # every collective lctrain's context-parallel attention issues is staged on gloo + CUDA
    assert not {"all_to_all", "all_gather", "reduce_scatter", "send", "recv"} & GLOO_CUDA_OPS
