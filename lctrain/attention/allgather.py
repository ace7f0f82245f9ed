"""All-gather KV attention (Llama 3 style): K/V of every cp rank gathered, local queries attend.

Each rank keeps its own (zigzag) queries, gathers K and V over the cp group, and attends with the
true global positions of both, so causal offsets are exact. The backward reduce-scatters dK/dV
back to their owners. Elements sent per rank (docs/parallelism.md §8): forward
(P-1) * 2 * (L/P) * d_kv (all-gather); backward 2 * (P-1)/P * L * d_kv (reduce-scatter of the
gathered gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.calls import Block
from lctrain.attention.kernels import DEFAULT_KERNEL, KernelOptions
from lctrain.attention.local import local_attention
from lctrain.layout.comm import all_gather, current_tag, reduce_scatter, traffic_tag


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence; backward reduce-scatters (sums) back to the owners."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.tag = group, current_tag()
        return all_gather(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        with traffic_tag(ctx.tag):
            return reduce_scatter(grad.contiguous(), ctx.group, dim=1), None


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block,
                        group: dist.ProcessGroup, *, causal: bool, scale: float,
                        options: KernelOptions = DEFAULT_KERNEL) -> tuple[Tensor, Tensor]:
    """q/k/v local [B, S/P, *, d]; qb: local positions; kb: positions of all ranks' tokens in
    group-rank order. Returns (out [B, S/P, H, d], lse [B, H, S/P])."""
    k, v = _GatherSequence.apply(k, group), _GatherSequence.apply(v, group)
    return local_attention(q, k, v, qb, kb, causal=causal, scale=scale, options=options)
