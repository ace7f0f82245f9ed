"""USP = Ulysses x Ring (Fang & Zhao; traffic in docs/parallelism.md §7).

Inside each group of `ulysses_degree` ranks an all-to-all turns sequence shards into head shards;
ranks holding the same heads in the cp/ulysses_degree groups then run Ring attention over the
groups' token sets, and the inverse all-to-all restores [B, S/cp, H, d]. With ulysses_degree=1 it
is Ring, with ulysses_degree=cp it is Ulysses.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from lctrain.attention.algorithms import CPAttention, CPGroups, ring_group_blocks
from lctrain.attention.calls import Block, KeyBlocks
from lctrain.attention.kernels import DEFAULT_KERNEL, KernelOptions
from lctrain.attention.ring import ring_attention
from lctrain.attention.ulysses import (
    gather_heads,
    head_shard,
    in_block_order,
    in_position_order,
    replicate_kv,
    scatter_heads,
)


def usp_attention(q: Tensor, k: Tensor, v: Tensor, blocks: KeyBlocks,
                  ulysses_group: dist.ProcessGroup, ring_group: dist.ProcessGroup, *,
                  causal: bool, scale: float, kv_replication: int = 1,
                  options: KernelOptions = DEFAULT_KERNEL, window: int | None = None,
                  sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [B, S/cp, H, d], k/v [B, S/cp, H_kv, d]; blocks[i]: token positions of ring group i
    (its Ulysses members' tokens in member order). Returns (out [B, S/cp, H, d],
    lse [B, H/u, S/ring] of the core). The caller checks the heads first (`check_heads`)."""
    k, v = replicate_kv(k, v, kv_replication)
    # every group sorts its tokens by position (fewer runs, fewer calls); the K/V blocks that
    # travel the ring are then in their owners' position order
    ordered = blocks[dist.get_rank(ring_group)].ordered
    q, k, v = in_position_order(ordered, *(scatter_heads(x, ulysses_group) for x in (q, k, v)))
    out, lse = ring_attention(q, k, v, ordered.block, blocks.ordered,
                              ring_group, causal=causal, scale=scale, options=options,
                              window=window, sink=head_shard(sink, ulysses_group))
    out, lse = in_block_order(ordered, out, lse)
    return gather_heads(out, ulysses_group), lse


def attend(q: Tensor, k: Tensor, v: Tensor, query: Block, keys: list[Block], groups: CPGroups,
           *, causal: bool, scale: float, kv_replication: int = 1,
           options: KernelOptions = DEFAULT_KERNEL, window: int | None = None,
           sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The registry's contract (algorithms.py): the key blocks are the ring groups' tokens."""
    return usp_attention(q, k, v, keys, groups.ulysses, groups.ring, causal=causal, scale=scale,
                         kv_replication=kv_replication, options=options, window=window,
                         sink=sink)


USP = CPAttention("usp", attend, ring_group_blocks)
