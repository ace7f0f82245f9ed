"""Ring attention (Liu et al.): Q stays, K/V blocks travel around the ring.

Forward: P steps; at each the next K/V block is already in flight (double buffer, batch_isend_irecv)
while the current one is computed; partial results merge through (out, lse). Backward: K/V travel
again for recompute, and each block's dK/dV accumulator travels with it, collecting every rank's
contribution, and reaches its owner after P-1 hops (reduce-scatter semantics). dQ stays local.
Blocks hidden by the causal mask are skipped inside the kernels (see kernels.py).

Elements sent per rank (docs/parallelism.md §6): forward (P-1) * 2 * (L/P) * d_kv; backward
twice that (K/V again, plus dK/dV). With packed documents only the tokens other ranks attend
travel (travel.py): L/P becomes the travelling n per row (§24). The dK/dV accumulators travel in float32, so that summing P
contributions in bf16 does not lose precision: in bytes, that half costs 4 per element.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.algorithms import CPAttention, CPGroups, ring_group_blocks
from lctrain.attention.calls import Block
from lctrain.attention.halo import halo_attention
from lctrain.attention.kernels import (
    DEFAULT_KERNEL,
    KernelOptions,
    acc_dtype,
    attend_backward,
    attend_forward,
    new_accumulators,
    sink_grad,
)
from lctrain.attention.local import save_final
from lctrain.attention.travel import Travel, travel_plan
from lctrain.comm import RingExchange, current_tag, traffic_tag

KV_TAG, GRAD_TAG = 11, 12


def _key_blocks(blocks: list[Block], travel: list[Travel] | None) -> list[Block]:
    """The blocks of the keys that arrive: whole blocks, or their travelling tokens."""
    return blocks if travel is None else [t.block for t in travel]


def _steps(size: int, travel: list[Travel] | None) -> int:
    """Ring steps: every block's, or only the own one's when no token of any block travels."""
    return 1 if travel is not None and travel[0].size == 0 else size


def ring_forward(q: Tensor, k: Tensor, v: Tensor, qb: Block, blocks: list[Block],
                 group: dist.ProcessGroup, causal: bool, scale: float,
                 options: KernelOptions) -> tuple[Tensor, Tensor]:
    """blocks[j]: positions of ring rank j's keys. Returns (out f32, lse f32) for local q.
    With documents only each block's travelling tokens go round (travel.py)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    out, lse = new_accumulators(q)
    travel = travel_plan(blocks, causal)
    arriving, steps = _key_blocks(blocks, travel), _steps(size, travel)
    exchange = RingExchange(group, tag=KV_TAG)
    kv = [k, v] if travel is None else [travel[rank].gather(x) for x in (k, v)]
    for step in range(steps):
        if step < steps - 1:
            exchange.start(kv)
        if step == 0:
            attend_forward(q, k, v, qb, blocks[rank], causal, scale, out, lse, options)
        else:
            attend_forward(q, *kv, qb, arriving[(rank - step) % size], causal, scale, out, lse,
                           options)
        if step < steps - 1:
            kv = exchange.wait()
    return out, lse


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  qb: Block, blocks: list[Block], group: dist.ProcessGroup, causal: bool,
                  scale: float, options: KernelOptions) -> tuple[Tensor, Tensor, Tensor]:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    travel = travel_plan(blocks, causal)
    arriving, steps = _key_blocks(blocks, travel), _steps(size, travel)
    dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    kv_exchange = RingExchange(group, tag=KV_TAG)
    grad_exchange = RingExchange(group, tag=GRAD_TAG)
    kv = [k, v] if travel is None else [travel[rank].gather(x) for x in (k, v)]
    own_dk, own_dv = (torch.zeros(x.shape, dtype=acc_dtype(x), device=x.device) for x in (k, v))
    for step in range(steps):
        if step < steps - 1:
            kv_exchange.start(kv)
        if step == 0:  # our block: its travelling accumulator comes back at the end
            attend_backward(dout, q, k, v, out, lse, qb, blocks[rank], causal, scale, dq,
                            own_dk, own_dv, options)
        else:
            dk, dv = (torch.zeros(x.shape, dtype=acc_dtype(x), device=x.device) for x in kv)
            attend_backward(dout, q, *kv, out, lse, qb, arriving[(rank - step) % size], causal,
                            scale, dq, dk, dv, options)
            if step > 1:  # the accumulator of this block, from the ranks that held it before
                dk_in, dv_in = grad_exchange.wait()
                dk += dk_in
                dv += dv_in
            grad_exchange.start([dk, dv])
        if step < steps - 1:
            kv = kv_exchange.wait()
    if steps > 1:
        dk_in, dv_in = grad_exchange.wait()
        if travel is None:
            own_dk += dk_in
            own_dv += dv_in
        else:
            travel[rank].add_into(own_dk, dk_in)
            travel[rank].add_into(own_dv, dv_in)
    return dq, own_dk, own_dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, qb, blocks, group, causal, scale, options):
        out, lse = ring_forward(q, k, v, qb, blocks, group, causal, scale, options)
        ctx.args, ctx.tag = (qb, blocks, group, causal, scale, options), current_tag()
        return save_final(ctx, q, k, v, out, lse, sink)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        with traffic_tag(ctx.tag):
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                sink_grad(dout, out, lse, ctx.sink), None, None, None, None, None, None)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, qb: Block, blocks: list[Block],
                   group: dist.ProcessGroup, *, causal: bool, scale: float,
                   options: KernelOptions = DEFAULT_KERNEL, window: int | None = None,
                   sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [B, Sq, H, d], k/v [B, Sk, H_kv, d] local -> (out [B, Sq, H, d], lse [B, H, Sq]).
    A window layer exchanges halos instead (halo.py): no block goes round the ring. `sink`:
    attention sinks [H] (kernels.add_sink)."""
    if window is not None:
        return halo_attention(q, k, v, blocks, group, scale=scale, window=window,
                              options=options, sink=sink)
    return _RingAttention.apply(q, k, v, sink, qb, blocks, group, causal, scale, options)


def attend(q: Tensor, k: Tensor, v: Tensor, query: Block, keys: list[Block], groups: CPGroups,
           *, causal: bool, scale: float, kv_replication: int = 1,
           options: KernelOptions = DEFAULT_KERNEL, window: int | None = None,
           sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The registry's contract (algorithms.py): Ring over the cp ring (whole KV heads: no
    replication)."""
    return ring_attention(q, k, v, query, keys, groups.ring, causal=causal, scale=scale,
                          options=options, window=window, sink=sink)


RING = CPAttention("ring", attend, ring_group_blocks)
