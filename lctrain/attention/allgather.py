"""All-gather KV attention (Llama 3 style): K/V of every cp rank gathered, local queries attend.

Each rank keeps its own (zigzag) queries, gathers K and V over the cp group, and attends with the
true global positions of both, so causal offsets are exact. The backward reduce-scatters dK/dV
back to their owners in float32 (summed over ranks at the precision Ring sums them). Elements
sent per rank (docs/parallelism.md §8): forward (P-1) * 2 * (L/P) * d_kv (all-gather, compute
dtype); backward 2 * (P-1)/P * L * d_kv (reduce-scatter of the gathered gradients, float32).
With packed documents each rank gathers only the other ranks' travelling tokens (travel.py):
L/P becomes the travelling n per row (§24).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain import device
from lctrain.attention.algorithms import CPAttention, CPGroups, rank_blocks
from lctrain.attention.calls import Block, KeyBlocks
from lctrain.attention.halo import halo_attention
from lctrain.attention.kernels import DEFAULT_KERNEL, KernelOptions, acc_dtype, sink_grad
from lctrain.attention.local import block_backward, forward_and_save
from lctrain.attention.travel import Travel, travel_plan
from lctrain.comm import all_gather, current_tag, reduce_scatter, traffic_tag


class _AllGatherAttention(torch.autograd.Function):
    """Gather K/V, attend; the backward's dK/dV stay in the float32 accumulators through the
    reduce-scatter (the sum over ranks in float32, as Ring's travelling dK/dV are) and take the
    input dtype only once summed."""

    @staticmethod
    def forward(ctx, q, k, v, sink, qb, kb, group, causal, scale, options):
        ctx.group, ctx.tag = group, current_tag()
        k_all, v_all = all_gather(k, group, dim=1), all_gather(v, group, dim=1)
        return forward_and_save(ctx, q, k_all, v_all, qb, kb, causal, scale, options, sink=sink)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout.contiguous(), q, k_all, v_all, out, lse, *ctx.args,
                                    keep_acc=True)
        with traffic_tag(ctx.tag):
            dk, dv = (reduce_scatter(g.to(acc_dtype(g)).contiguous(), ctx.group, dim=1)
                      for g in (dk, dv))
        return (dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype),
                sink_grad(dout, out, lse, ctx.sink), None, None, None, None, None, None)


class _SharedKVAttention(torch.autograd.Function):
    """With packed documents: gather only every other rank's travelling K/V (travel.py) and
    attend to the own K/V and those; the backward reduce-scatters the travelling tokens'
    gradients (float32) to their owners, who add them to their own tokens'."""

    @staticmethod
    def forward(ctx, q, k, v, sink, qb, blocks, group, causal, scale, options):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        travel = travel_plan(blocks, causal)
        ctx.group, ctx.tag, ctx.travel, ctx.local = group, current_tag(), travel[rank], k.shape[1]
        if travel[0].size == 0:  # no document crosses ranks: nothing to gather
            return forward_and_save(ctx, q, k, v, qb, blocks[rank], causal, scale, options,
                                    sink=sink)
        k_all, v_all = (torch.cat([x, *_others(all_gather(travel[rank].gather(x), group, dim=1),
                                               rank, size)], dim=1) for x in (k, v))
        return forward_and_save(ctx, q, k_all, v_all, qb, _joined(blocks, travel, rank, causal),
                                causal, scale, options, sink=sink)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        dq, dk_all, dv_all = block_backward(dout.contiguous(), q, k_all, v_all, out, lse,
                                            *ctx.args, keep_acc=True)
        grads = []
        for g in (dk_all, dv_all):
            mine = g[:, :ctx.local].to(acc_dtype(g)).clone()
            if g.shape[1] > ctx.local:
                rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
                parts = list(g[:, ctx.local:].to(acc_dtype(g)).chunk(size - 1, dim=1))
                parts.insert(rank, torch.zeros_like(parts[0]))  # our own slot: nothing for us
                with traffic_tag(ctx.tag):
                    ctx.travel.add_into(mine, reduce_scatter(torch.cat(parts, dim=1), ctx.group,
                                                             dim=1))
            grads.append(mine)
        dk, dv = grads
        return (dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype),
                sink_grad(dout, out, lse, ctx.sink), None, None, None, None, None, None)


def _others(gathered: Tensor, rank: int, size: int) -> list[Tensor]:
    """The other ranks' slots of an all-gathered [B, size * n, ...] tensor, in rank order."""
    slots = gathered.chunk(size, dim=1)
    return [x for j, x in enumerate(slots) if j != rank]


@device.on_host
def _joined(blocks: KeyBlocks, travel: list[Travel], rank: int, causal: bool) -> Block:
    """The key block of the own tokens followed by every other rank's travelling tokens (the
    order `_SharedKVAttention` concatenates K/V in); made once per micro-batch (the blocks'
    `joined`)."""
    if (rank, causal) not in blocks.joined:
        parts = [blocks[rank]] + [t.block for j, t in enumerate(travel) if j != rank]
        blocks.joined[rank, causal] = Block(torch.cat([b.row_pos for b in parts], dim=1),
                                            torch.cat([b.doc for b in parts], dim=1))
    return blocks.joined[rank, causal]


@device.on_host
def _all_tokens(blocks: KeyBlocks) -> Block:
    """Every rank's tokens as one key block, in rank order (no documents); made once per
    micro-batch (the blocks' `all_tokens`)."""
    if blocks.all_tokens is None:
        blocks.all_tokens = Block(torch.cat([b.pos for b in blocks], dim=-1))
    return blocks.all_tokens


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, qb: Block, blocks: list[Block],
                        group: dist.ProcessGroup, *, causal: bool, scale: float,
                        options: KernelOptions = DEFAULT_KERNEL,
                        sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q/k/v local [B, S/P, *, d]; qb: local positions; blocks: every rank's tokens, in
    group-rank order (this rank's is qb's). Returns (out [B, S/P, H, d], lse [B, H, S/P])."""
    if qb.doc is not None:
        return _SharedKVAttention.apply(q, k, v, sink, qb, blocks, group, causal, scale, options)
    return _AllGatherAttention.apply(q, k, v, sink, qb, _all_tokens(blocks), group, causal,
                                     scale, options)


def attend(q: Tensor, k: Tensor, v: Tensor, query: Block, keys: list[Block], groups: CPGroups,
           *, causal: bool, scale: float, kv_replication: int = 1,
           options: KernelOptions = DEFAULT_KERNEL, window: int | None = None,
           sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The registry's contract (algorithms.py): the key blocks are every rank's tokens. A window
    layer exchanges halos instead of gathering (halo.py)."""
    if window is not None:
        return halo_attention(q, k, v, keys, groups.cp, scale=scale, window=window,
                              options=options, sink=sink)
    return allgather_attention(q, k, v, query, keys, groups.cp, causal=causal, scale=scale,
                               options=options, sink=sink)


ALLGATHER = CPAttention("allgather", attend, rank_blocks)
