"""Ulysses (DeepSpeed): all-to-all from sequence shards to head shards.

[B, S/P, H, d] per rank -> [B, S, H/P, d]: every rank then sees the whole sequence of its Ulysses
group for H/P heads and can run any local kernel; the inverse all-to-all restores the output.
Elements sent per rank, one forward: (2 d + 2 d_kv) * L * (P-1) / P^2 (Q, K, V and the output;
docs/parallelism.md §5).

GQA: when the Ulysses degree does not divide the KV heads, each KV head is repeated
`kv_replication` times first (the smallest count that splits evenly and keeps the query groups
aligned; `lctrain.config.derived.kv_replication`); autograd sums the copies' gradients back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.algorithms import CPAttention, CPGroups, ring_group_blocks
from lctrain.attention.calls import Block, Ordered
from lctrain.attention.kernels import DEFAULT_KERNEL, KernelOptions
from lctrain.attention.local import local_attention
from lctrain.comm import all_to_all_autograd
from lctrain.layout.sequence import take


def scatter_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[B, S/P, H, d] -> [B, S, H/P, d] (sequence in group-rank order)."""
    return all_to_all_autograd(x, group, scatter_dim=2, gather_dim=1)


def gather_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[B, S, H/P, d] -> [B, S/P, H, d]: the inverse of scatter_heads."""
    return all_to_all_autograd(x, group, scatter_dim=1, gather_dim=2)


class _Permute(torch.autograd.Function):
    """x's tokens (dim 1) in another order (index [S], or [B, S] per row); the backward applies
    the inverse order."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.inverse = inverse
        return take(x, index, 1)

    @staticmethod
    def backward(ctx, grad):
        return take(grad, ctx.inverse, 1), None, None


def in_position_order(ordered: Ordered, *xs: Tensor) -> list[Tensor]:
    """xs [B, S, ...] with their tokens sorted by position (as `ordered.block` lists them)."""
    if ordered.index is None:
        return list(xs)
    index, inverse = ordered.on(xs[0].device)
    return [_Permute.apply(x, index, inverse) for x in xs]


def in_block_order(ordered: Ordered, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of `in_position_order` for the attention output and its lse [B, H, S]."""
    if ordered.index is None:
        return out, lse
    index, inverse = ordered.on(out.device)
    return _Permute.apply(out, inverse, index), take(lse, inverse, 2)


def head_shard(sink: Tensor | None, group: dist.ProcessGroup) -> Tensor | None:
    """The attention sinks [H] of the heads this rank holds after `scatter_heads` (its group
    rank's H/P, in order); autograd sends their gradient back into the whole tensor."""
    if sink is None:
        return None
    return sink.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def replicate_kv(k: Tensor, v: Tensor, times: int) -> tuple[Tensor, Tensor]:
    if times == 1:
        return k, v
    return k.repeat_interleave(times, dim=2), v.repeat_interleave(times, dim=2)


def check_heads(q: Tensor, k: Tensor, degree: int, kv_replication: int = 1) -> None:
    """Raise before any collective if the heads cannot split over `degree` ranks."""
    hq, hkv = q.shape[2], k.shape[2] * kv_replication
    if hq % degree or hkv % degree or hq % hkv:
        raise ValueError(f"Ulysses degree {degree} needs the query heads ({hq}) and the KV heads "
                         f"({k.shape[2]} x replication {kv_replication} = {hkv}) divisible by it, "
                         "and query heads a multiple of KV heads; fix model.n_heads / parallel.* "
                         "(lctrain plan shows the valid layouts)")


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, qb: Block, group: dist.ProcessGroup, *,
                      causal: bool, scale: float, kv_replication: int = 1,
                      options: KernelOptions = DEFAULT_KERNEL, window: int | None = None,
                      sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [B, S/P, H, d], k/v [B, S/P, H_kv, d] local; qb: positions of the whole Ulysses group's
    tokens in group-rank order; a window layer's window applies in the local kernel. Returns
    (out [B, S/P, H, d], lse [B, H/P, S] of the core).
    The caller checks the heads first (`check_heads`, before any collective)."""
    k, v = replicate_kv(k, v, kv_replication)
    # the group's tokens arrive in rank order; in position order a zigzag split is one run, so
    # attention is a single kernel call with no float32 accumulators to merge into
    ordered = qb.ordered
    q, k, v = in_position_order(ordered, *(scatter_heads(x, group) for x in (q, k, v)))
    out, lse = local_attention(q, k, v, ordered.block, ordered.block, causal=causal,
                               scale=scale, options=options, window=window,
                               sink=head_shard(sink, group))
    out, lse = in_block_order(ordered, out, lse)
    return gather_heads(out, group), lse


def attend(q: Tensor, k: Tensor, v: Tensor, query: Block, keys: list[Block], groups: CPGroups,
           *, causal: bool, scale: float, kv_replication: int = 1,
           options: KernelOptions = DEFAULT_KERNEL, window: int | None = None,
           sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The registry's contract (algorithms.py): Ulysses over the cp group's Ulysses axis, which
    is all of it (the query block is the whole group's tokens)."""
    return ulysses_attention(q, k, v, query, groups.ulysses, causal=causal, scale=scale,
                             kv_replication=kv_replication, options=options, window=window,
                             sink=sink)


ULYSSES = CPAttention("ulysses", attend, ring_group_blocks)
