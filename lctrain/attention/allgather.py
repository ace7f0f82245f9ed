"""All-gather KV attention (Llama 3 style): K/V of every cp rank gathered, local queries attend.

Each rank keeps its own (zigzag) queries, gathers K and V over the cp group, and attends with the
true global positions of both, so causal offsets are exact. The backward reduce-scatters dK/dV
back to their owners in float32 (summed over ranks at the precision Ring sums them). Elements
sent per rank (docs/parallelism.md §8): forward (P-1) * 2 * (L/P) * d_kv (all-gather, compute
dtype); backward 2 * (P-1)/P * L * d_kv (reduce-scatter of the gathered gradients, float32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.algorithms import CPAttention, CPGroups, all_keys_blocks
from lctrain.attention.calls import Block
from lctrain.attention.kernels import DEFAULT_KERNEL, KernelOptions, acc_dtype
from lctrain.attention.local import block_backward, forward_and_save
from lctrain.layout.comm import all_gather, current_tag, reduce_scatter, traffic_tag


class _AllGatherAttention(torch.autograd.Function):
    """Gather K/V, attend; the backward's dK/dV stay in the float32 accumulators through the
    reduce-scatter (the sum over ranks in float32, as Ring's travelling dK/dV are) and take the
    input dtype only once summed."""

    @staticmethod
    def forward(ctx, q, k, v, qb, kb, group, causal, scale, options):
        ctx.group, ctx.tag = group, current_tag()
        k_all, v_all = all_gather(k, group, dim=1), all_gather(v, group, dim=1)
        return forward_and_save(ctx, q, k_all, v_all, qb, kb, causal, scale, options)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout.contiguous(), q, k_all, v_all, out, lse, *ctx.args,
                                    keep_acc=True)
        with traffic_tag(ctx.tag):
            dk, dv = (reduce_scatter(g.to(acc_dtype(g)).contiguous(), ctx.group, dim=1)
                      for g in (dk, dv))
        return (dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None, None, None, None,
                None, None)


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block,
                        group: dist.ProcessGroup, *, causal: bool, scale: float,
                        options: KernelOptions = DEFAULT_KERNEL) -> tuple[Tensor, Tensor]:
    """q/k/v local [B, S/P, *, d]; qb: local positions; kb: positions of all ranks' tokens in
    group-rank order. Returns (out [B, S/P, H, d], lse [B, H, S/P])."""
    return _AllGatherAttention.apply(q, k, v, qb, kb, group, causal, scale, options)


def attend(q: Tensor, k: Tensor, v: Tensor, query: Block, keys: list[Block], groups: CPGroups,
           *, causal: bool, scale: float, kv_replication: int = 1,
           options: KernelOptions = DEFAULT_KERNEL) -> tuple[Tensor, Tensor]:
    """The registry's contract (algorithms.py): one key block, every rank's tokens."""
    return allgather_attention(q, k, v, query, keys[0], groups.cp, causal=causal, scale=scale,
                               options=options)


ALLGATHER = CPAttention("allgather", attend, all_keys_blocks)
