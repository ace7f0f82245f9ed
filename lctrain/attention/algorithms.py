"""The code that runs each context-parallel algorithm, registered by name beside its facts.

`lctrain.config.cp_algorithms` holds what every layer asks about an algorithm (its Ulysses
degree, traffic, memory, timing); this registry holds what only the attention layer needs: the
blocks of tokens it attends to and the function that runs it, under one contract

    attend(q, k, v, query, keys, groups, *, causal, scale, kv_replication, options, window,
           sink) -> (out, lse)

q [B, S/cp, H, d] and k/v [B, S/cp, H_kv, d] are this rank's shards; `query` and `keys` are the
`Block`s its `blocks` rule chose; `window` is a sliding window of that many keys (causal; None
for a full layer), which an algorithm honours in compute and communication (halo.py); `sink`
the attention sinks [H] (None: none), which it adds once to its merged result
(kernels.add_sink, in the Function that saves what its backward needs). Each
algorithm's module (ring.py, ulysses.py, usp.py, allgather.py) defines its entry;
`lctrain.attention` registers them. docs/extending.md is the checklist for a new one;
`registered` adds one for the length of a block (tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.config.cp_algorithms import CP_ALGORITHMS, CPAlgorithm
from lctrain.config.registry import Registry


@dataclass(frozen=True)
class CPGroups:
    """This rank's place in the cp groups (cp_rank = ring_rank * ulysses_size + ulysses_rank)."""

    cp: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None
    ulysses: dist.ProcessGroup | None
    ring_size: int = 1
    ring_rank: int = 0
    ulysses_size: int = 1
    ulysses_rank: int = 0

    @property
    def cp_size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def cp_rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank


BlocksRule = Callable[[list[Tensor], CPGroups], tuple[Tensor, list[Tensor]]]
"""(positions of each cp rank's tokens, [S/cp] or [B, S/cp], groups) -> (positions of this
rank's query block, positions of each key block it attends to), tokens on the last dim. Return
the same tensor object for a query block that is also a key block: they become one `Block`,
planned once."""


def ring_group_blocks(pos: list[Tensor], groups: CPGroups) -> tuple[Tensor, list[Tensor]]:
    """The tokens of each ring group (its Ulysses members' tokens, in member order): this rank's
    group queries, every group's tokens are keys (Ring, Ulysses, USP)."""
    u = groups.ulysses_size
    group_pos = [torch.cat(pos[i * u:(i + 1) * u], dim=-1) for i in range(groups.ring_size)]
    return group_pos[groups.ring_rank], group_pos


def all_keys_blocks(pos: list[Tensor], groups: CPGroups) -> tuple[Tensor, list[Tensor]]:
    """This rank's tokens query; every rank's tokens, in cp-rank order, are one key block."""
    return pos[groups.cp_rank], [torch.cat(pos, dim=-1)]


def rank_blocks(pos: list[Tensor], groups: CPGroups) -> tuple[Tensor, list[Tensor]]:
    """This rank's tokens query; each rank's tokens are a key block, in cp-rank order
    (all-gather KV: gathered whole, or only their travelling tokens with documents)."""
    return pos[groups.cp_rank], pos


@dataclass(frozen=True)
class CPAttention:
    """How the attention layer runs one algorithm: the blocks it attends to and its function."""

    name: str
    attend: Callable[..., tuple[Tensor, Tensor]]
    """The contract of this module's docstring."""
    blocks: BlocksRule


CP_ATTENTION: Registry[CPAttention] = Registry("context-parallel attention implementation")
"""The implementations, by the names of `lctrain.config.cp_algorithms.CP_ALGORITHMS`."""


def register(entry: CPAttention) -> CPAttention:
    return CP_ATTENTION.add(entry)


@contextlib.contextmanager
def registered(facts: CPAlgorithm, attention: CPAttention) -> Iterator[None]:
    """A new algorithm's two entries registered inside the block (its name valid everywhere:
    schema, validation, planning, the attention layer), both removed after it."""
    assert facts.name == attention.name, (facts.name, attention.name)
    with CP_ALGORITHMS.registered(facts), CP_ATTENTION.registered(attention):
        yield
