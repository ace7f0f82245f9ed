"""Window layers under context parallelism: a halo exchange instead of a ring.

A query of a sliding-window layer sees only the W keys ending at its own position (W = the
window; with packed documents, only its own document's). A token of rank j's key block is then
needed by rank i only if i holds a query of the same document at most W - 1 positions after it.
Each rank sends every other rank exactly those of its tokens, point to point and all pairs at
once, attends to its own block while they travel, then to what arrived; the backward sends the
dK/dV of the received tokens back along the same pairs (float32, as Ring's). No K/V reaches a
rank whose queries all lie more than W - 1 positions after it, and the elements a rank sends are
proportional to W, not to S (docs/parallelism.md §25). Ring, USP's ring and all-gather KV take
this path for window layers; Ulysses holds the whole sequence after its all-to-all and applies
the window in its local kernel.

Peers' token sets are `Travel`s (travel.py): local indices, padded per row to the most any row
needs when each row has its own documents, and the tokens as a `Block`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lctrain import device
from lctrain.attention.calls import Block
from lctrain.attention.kernels import (
    KernelOptions,
    acc_dtype,
    attend_backward,
    attend_forward,
    new_accumulators,
    sink_grad,
)
from lctrain.attention.local import save_final
from lctrain.attention.travel import Travel, padded_travel
from lctrain.comm import PeerExchange, current_tag, traffic_tag
from lctrain.layout.halo import needed_by, window_keys

HALO_TAG = 13


@dataclass(frozen=True)
class Halo:
    """One rank's halo exchange: by peer (group rank), the own tokens it sends and the peer's
    tokens it receives."""

    send: dict[int, Travel]
    recv: dict[int, Travel]


@device.on_host
def halo_plan(blocks: list[Block], rank: int, window: int) -> Halo:
    """The halo of `rank`, whose tokens are blocks[rank], among key blocks that are also their
    ranks' queries (block i: group rank i's tokens). Planned once per list of blocks."""
    key = ("halo", rank, window, tuple(id(b) for b in blocks))
    cached = blocks[rank]._plans.get(key)
    if cached is None or any(a is not b for a, b in zip(cached[0], blocks)):
        own = blocks[rank]
        # blocks that share no document with this one exchange nothing: skipped without
        # looking at their tokens
        peers = [j for j, b in enumerate(blocks) if j != rank and _share_documents(own, b)]
        keys = _WindowKeys(blocks, window)  # each block's keys made and sorted once
        send = {j: t for j in peers if (t := keys.needed(own, blocks[j])) is not None}
        recv = {j: t for j in peers if (t := keys.needed(blocks[j], own)) is not None}
        cached = (list(blocks), Halo(send, recv))
        blocks[rank]._plans[key] = cached
    return cached[1]


def _documents(block: Block) -> np.ndarray | None:
    """The document ids a block holds, sorted (None without documents), found once."""
    if block.doc is None:
        return None
    if "documents" not in block._plans:  # the first id of each stretch: a few per row
        ids = block.doc.numpy()
        starts = np.ones(ids.shape, dtype=bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        block._plans["documents"] = np.unique(ids[starts])
    return block._plans["documents"]


def _share_documents(a: Block, b: Block) -> bool:
    """Whether two blocks hold a token of one document (always, without documents)."""
    da, db = _documents(a), _documents(b)
    return da is None or db is None or len(np.intersect1d(da, db, assume_unique=True)) > 0


def _travel(keys: Block, queries: Block, needed: Tensor) -> Travel | None:
    """The `needed` [R, S] tokens of `keys` as a Travel; None when there are none."""
    if not bool(needed.any()):
        return None
    if keys.doc is None:
        index = needed[0].nonzero()[:, 0]
        return Travel(index, Block(keys.pos[index]))
    no_doc = min(int(keys.doc.min()), int(queries.doc.min())) - 1  # a document no query has
    return padded_travel(keys, needed, no_doc)


class _WindowKeys:
    """Between any two of `blocks`: the tokens of the first (keys) that a query of the second
    sees through a causal window (same document, at most window - 1 positions before it), as
    `lctrain.layout.halo.window_needed` finds them, with each block's (document, position) keys
    made once and, as queries, sorted once."""

    def __init__(self, blocks: list[Block], window: int):
        self.window = window
        docs = [b.doc for b in blocks if b.doc is not None]
        self.low = min(int(d.min()) for d in docs) if docs else 0
        self.span = max(int(b.pos.max()) for b in blocks) + window + 1
        self._keys: dict[int, Tensor] = {}
        self._sorted: dict[int, Tensor] = {}

    def _of(self, block: Block) -> Tensor:
        if id(block) not in self._keys:
            self._keys[id(block)] = window_keys(block.pos, block.doc, self.low, self.span)
        return self._keys[id(block)]

    def needed(self, keys: Block, queries: Block) -> Travel | None:
        if id(queries) not in self._sorted:
            self._sorted[id(queries)] = self._of(queries).sort(dim=1).values
        return _travel(keys, queries,
                       needed_by(self._sorted[id(queries)], self._of(keys), self.window))


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
