"""Window layers under context parallelism: a halo exchange instead of a ring.

A query of a sliding-window layer sees only the W keys ending at its own position (W = the
window; with packed documents, only its own document's); which of a rank's tokens another rank
needs is `lctrain.layout.halo`'s rule (`needed`). Each rank sends every other rank exactly those
of its tokens, point to point and all pairs at once, attends to its own block while they travel,
then to what arrived; the backward sends the dK/dV of the received tokens back along the same
pairs (float32, as Ring's). No K/V reaches a
rank whose queries all lie more than W - 1 positions after it, and the elements a rank sends are
proportional to W, not to S (docs/parallelism.md §25). Ring, USP's ring and all-gather KV take
this path for window layers; Ulysses holds the whole sequence after its all-to-all and applies
the window in its local kernel.

Peers' token sets are `Travel`s (travel.py): local indices, padded per row to the most any row
needs when each row has its own documents, and the tokens as a `Block`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain import device
from lctrain.attention.calls import Block, KeyBlocks
from lctrain.attention.kernels import (
    KernelOptions,
    acc_dtype,
    attend_backward,
    attend_forward,
    new_accumulators,
    sink_grad,
)
from lctrain.attention.local import save_final
from lctrain.attention.travel import Travel, stretch_travel
from lctrain.comm import PeerExchange, current_tag, traffic_tag
from lctrain.layout.halo import needed
from lctrain.layout.segments import expand

HALO_TAG = 13


@dataclass(frozen=True)
class Halo:
    """One rank's halo exchange: by peer (group rank), the own tokens it sends and the peer's
    tokens it receives."""

    send: dict[int, Travel]
    recv: dict[int, Travel]


@device.on_host
def halo_plan(blocks: KeyBlocks, rank: int, window: int) -> Halo:
    """The halo of `rank`, whose tokens are blocks[rank], among key blocks that are also their
    ranks' queries (block i: group rank i's tokens). Planned once per list of blocks, from
    their segments (`lctrain.layout.segments`): no step of it is per token but the indices it
    returns. Planned once per micro-batch (the blocks' `halo`)."""
    if (rank, window) not in blocks.halo:
        own, peers = blocks[rank], [j for j in range(len(blocks)) if j != rank]
        send = {j: t for j in peers if (t := _needed(own, blocks[j], window)) is not None}
        recv = {j: t for j in peers if (t := _needed(blocks[j], own, window)) is not None}
        blocks.halo[rank, window] = Halo(send, recv)
    return blocks.halo[rank, window]


def _needed(keys: Block, queries: Block, window: int) -> Travel | None:
    """The tokens of `keys` that a query of `queries` sees through a causal window (same
    document, at most window - 1 positions before it), as a Travel; None when there are none."""
    per_row = [needed(keys.segments(b), queries.segments(b), window)
               for b in range(1 if keys.doc is None else keys.doc.shape[0])]
    if all(len(first) == 0 for first, _ in per_row):
        return None
    if keys.doc is None:  # the same tokens in every row
        index = torch.from_numpy(expand(*per_row[0]))
        return Travel(index, Block(keys.pos[index]))
    no_doc = min(int(keys.doc.min()), int(queries.doc.min())) - 1  # a document no query has
    return stretch_travel(keys, per_row, no_doc)


def _exchange_shapes(travels: dict[int, Travel], like: Tensor) -> dict[int, list[torch.Size]]:
    """The shapes of K and V (or dK and dV) for each peer's tokens."""
    return {j: [torch.Size((like.shape[0], t.size, *like.shape[2:]))] * 2
            for j, t in travels.items()}


class _HaloAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, blocks, group, scale, window, options):
        rank = dist.get_rank(group)
        halo, own = halo_plan(blocks, rank, window), blocks[rank]
        exchange = PeerExchange(group, tag=HALO_TAG)
        exchange.start({j: [t.gather(k), t.gather(v)] for j, t in halo.send.items()},
                       _exchange_shapes(halo.recv, k), like=k)
        out, lse = new_accumulators(q)
        attend_forward(q, k, v, own, own, True, scale, out, lse, options, window)
        arrived = exchange.wait()
        for j, (kj, vj) in sorted(arrived.items()):
            attend_forward(q, kj, vj, own, halo.recv[j].block, True, scale, out, lse, options,
                           window)
        ctx.received = [x for j in sorted(arrived) for x in arrived[j]]
        ctx.args, ctx.peers = (blocks, group, scale, window, options), sorted(arrived)
        ctx.tag = current_tag()
        return save_final(ctx, q, k, v, out, lse, sink)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        received = ctx.received
        blocks, group, scale, window, options = ctx.args
        halo, own = halo_plan(blocks, dist.get_rank(group), window), blocks[dist.get_rank(group)]
        dout = dout.contiguous()
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc_dtype(x), device=x.device) for x in (q, k, v))
        attend_backward(dout, q, k, v, out, lse, own, own, True, scale, dq, dk, dv, options,
                        window)
        back = {}
        for i, j in enumerate(ctx.peers):
            kj, vj = received[2 * i], received[2 * i + 1]
            dkj, dvj = (torch.zeros(x.shape, dtype=acc_dtype(x), device=x.device) for x in (kj, vj))
            attend_backward(dout, q, kj, vj, out, lse, own, halo.recv[j].block, True, scale, dq,
                            dkj, dvj, options, window)
            back[j] = [dkj, dvj]
        exchange = PeerExchange(group, tag=HALO_TAG)
        with traffic_tag(ctx.tag):
            exchange.start(back, _exchange_shapes(halo.send, dk), like=dk)
        for j, (gk, gv) in exchange.wait().items():
            halo.send[j].add_into(dk, gk)
            halo.send[j].add_into(dv, gv)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                sink_grad(dout, out, lse, ctx.sink), None, None, None, None, None)


def halo_attention(q: Tensor, k: Tensor, v: Tensor, blocks: list[Block],
                   group: dist.ProcessGroup, *, scale: float, window: int,
                   options: KernelOptions, sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Causal sliding-window attention of this rank's tokens over the group: q [B, S, H, d],
    k/v [B, S, H_kv, d] at positions blocks[group rank] -> (out [B, S, H, d], lse [B, H, S]).
    `sink`: attention sinks [H] (kernels.add_sink)."""
    return _HaloAttention.apply(q, k, v, sink, blocks, group, scale, window, options)
