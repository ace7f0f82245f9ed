"""Every context-parallel algorithm, from the registry, with packed documents on 2 and 4 ranks
sharing the GPU (gloo, collectives staged through host memory), against float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_checks.context import (
    Context,
    error_over_tolerance,
    qkv,
)
from lctrain.attention import ContextParallelAttention
from lctrain.attention.calls import Block
from lctrain.attention.varlen_reference import register_cpu_flash_ops
from lctrain.comm import check_collective_devices
from lctrain.config.cp_algorithms import algorithm_layouts
from lctrain.layout import sequence
from lctrain.parallel.launch import run_ranks
from tests.reference import reference_attention

CP_CASES = [(name, ranks, ulysses) for ranks in (2, 4)
            for name, ulysses in algorithm_layouts(ranks)]
"""(algorithm, ranks, Ulysses degree): every registered algorithm on 2 and 4 ranks at each
Ulysses degree the layout search tries (USP: 2 on 4 ranks)."""


def _cp_rank(algorithm: str, ulysses: int, dry_run: bool) -> float:
    """One rank of a context-parallel case on the shared device; returns its worst error."""
    return cp_case_error(algorithm, ulysses, dry_run, "zigzag")


def _documents(s: int, load_balance: str) -> torch.Tensor:
    """Two rows of 3 documents, a long one crossing ranks and a short one: for zigzag the
    second row rolled (a document in two stretches); for the documents split, whose rows are
    runs of documents, other lengths."""
    lengths = [5, s // 2 - 2, s - s // 2 - 3]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    if load_balance == "zigzag":
        return torch.stack([ids, ids.roll(3)])
    other = torch.repeat_interleave(torch.arange(3), torch.tensor([s // 3, 5, s - s // 3 - 5]))
    return torch.stack([ids, other])


def cp_case_error(algorithm: str, ulysses: int, dry_run: bool, load_balance: str,
                  window: bool = False, sinks: bool = False) -> float:
    """One rank of a context-parallel case with packed documents on the shared device (a
    window of S/5 keys and attention sinks when asked) against float64; its worst error."""
    from lctrain.layout.topology import Topology
    from lctrain.parallel.runtime import build_mesh, cp_groups

    ctx = Context(dry_run, True)
    if dry_run:
        register_cpu_flash_ops()
    else:
        torch.cuda.set_device(0)
    world = dist.get_world_size()
    topo = Topology(cp_ring=world // ulysses, cp_ulysses=ulysses)
    groups = cp_groups(topo, build_mesh(topo, "cpu"), dist.get_rank())
    s = 16 * world if dry_run else 1024 * world
    docs = _documents(s, load_balance)
    w = s // 5 if window else None
    q, k, v, dout = qkv(2, s, 2 * world, world, 64, ctx.dtype, ctx.device)
    sink = (torch.randn(2 * world, generator=torch.Generator().manual_seed(1))
            .to(ctx.device, torch.float32) if sinks else None)
    full = Block(torch.arange(s), docs)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, full, full, True, 64 ** -0.5, window=w,
                                     sink=None if sink is None else sink.double())
    ref_out.backward(dout.double())

    def local(x):
        return sequence.split(x, 1, groups.cp_rank, groups.cp_size, load_balance,
                              doc_ids=docs, ulysses=ulysses)

    ins = [local(x).detach().requires_grad_() for x in (q, k, v)]
    attn = ContextParallelAttention(algorithm, groups, s, load_balance, options=ctx.kernel)
    with check_collective_devices():
        out = attn(*ins, docs, window=w, sink=sink)
        out.backward(local(dout))
    pairs = [(out, local(ref_out))] + [(a.grad, local(b.grad)) for a, b in zip(ins, ref_in)]
    return error_over_tolerance(pairs, ctx.tol(gqa=True))


def worst_over_ranks(ctx: Context, rank_fn, world: int, args: tuple) -> float:
    """`rank_fn(*args)` on `world` gloo ranks sharing the device: the worst error of any."""
    return max(run_ranks(rank_fn, world, args, start_method="fork" if ctx.dry_run else "spawn",
                         backend="gloo", timeout_s=120))


def check_cp_algorithms(ctx: Context) -> dict:
    rows = []
    for algorithm, world, ulysses in CP_CASES:
        worst = worst_over_ranks(ctx, _cp_rank, world, (algorithm, ulysses, ctx.dry_run))
        rows.append({"algorithm": algorithm, "ranks": world, "ulysses": ulysses,
                     "error_over_tolerance": round(worst, 3)})
    ok = all(r["error_over_tolerance"] <= 1 for r in rows)
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": "worst error / tolerance: " + ", ".join(
                f"{r['algorithm']} x{r['ranks']} {r['error_over_tolerance']:.2f}" for r in rows)}
