"""A toy context-parallel algorithm added the way docs/extending.md says: all-gather KV under
another name, written afresh from the communication primitives and the local kernel.

This one module plays the part of `lctrain/attention/<name>.py` (the function and its
`CPAttention` entry) and carries the facts entry that would go into
`lctrain/config/cp_algorithms.py` and the costs entry of `lctrain/planning/cp_costs.py`.
Nothing is registered on import: tests/test_cp_registry.py registers the three entries for the
length of a test (`toy_registered`), so no other test sees the name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lctrain.attention.algorithms import CPAttention, CPGroups, all_keys_blocks
from lctrain.attention.calls import Block
from lctrain.attention.kernels import DEFAULT_KERNEL, KernelOptions, acc_dtype
from lctrain.attention.local import local_attention
from lctrain.comm import all_gather, current_tag, reduce_scatter, traffic_tag
from lctrain.config.cp_algorithms import CPAlgorithm
from lctrain.planning.cp_costs import (
    CPCosts,
    MemoryTerms,
    TimingTerms,
    Transfer,
    gathered_kv,
    gathered_kv_grads,
    own_and_gathered,
)

NAME = "gather_kv"
KV_TENSORS = 2
"""K and V: each gathered forward, each gradient reduce-scattered backward."""


class _GatherTokens(torch.autograd.Function):
    """x [B, S/P, h, d] -> [B, S, h, d], every rank's tokens in cp-rank order; the backward
    reduce-scatters the gradient to the owners of the tokens, summed in float32."""

    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag, ctx.dtype = group, tag, x.dtype
        return all_gather(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        with traffic_tag(ctx.tag):
            mine = reduce_scatter(grad.to(acc_dtype(grad)).contiguous(), ctx.group, dim=1)
        return mine.to(ctx.dtype), None, None


def attend(q: Tensor, k: Tensor, v: Tensor, query: Block, keys: list[Block], groups: CPGroups,
           *, causal: bool, scale: float, kv_replication: int = 1,
           options: KernelOptions = DEFAULT_KERNEL, window: int | None = None,
           sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The registry's contract: gather K and V over the cp group, attend locally (the local
    kernel's autograd gives dK/dV of every token; the gather's backward sends them home). A
    window layer's window is applied in the local kernel (its K/V are still gathered whole)."""
    tag = current_tag()
    k_all, v_all = (_GatherTokens.apply(x, groups.cp, tag) for x in (k, v))
    return local_attention(q, k_all, v_all, query, keys[0], causal=causal, scale=scale,
                           options=options, window=window, sink=sink)


def transfers(L: float, d: float, d_kv: float, P: int, u: int) -> tuple[Transfer, ...]:
    """Each rank's L/P tokens of K and V to the P-1 others forward; (P-1)/P of the gathered
    float32 dK and dV backward: the same count (docs/parallelism.md §8)."""
    gathered = (P - 1) * KV_TENSORS * (L / P) * d_kv
    return (Transfer("all_gather", "fwd", "cp", gathered, calls=KV_TENSORS),
            Transfer("reduce_scatter", "bwd", "cp", gathered, calls=KV_TENSORS, float32=True))


FACTS = CPAlgorithm(
    NAME, "docs/parallelism.md §8", "every rank all-gathers the whole K and V (a toy)",
    heads_over="none")
"""The entry that would go into lctrain/config/cp_algorithms.py."""
COSTS = CPCosts(
    NAME, transfers,
    MemoryTerms(gathered_kv, gathered_kv_grads, block_tokens=own_and_gathered),
    TimingTerms(lambda R, u: {"allgather": 1.0}))  # all-gather's calibrated extra
"""The entry that would go into lctrain/planning/cp_costs.py."""
ATTENTION = CPAttention(NAME, attend, all_keys_blocks)
"""The entry that would be registered in lctrain/attention/__init__.py."""
