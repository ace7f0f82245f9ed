"""Context-parallel attention: one contract, one shared (out, lse) merge, one file per algorithm.

`ContextParallelAttention` is the attention core the model calls: it receives the local shards
q [B, S/cp, H, d], k/v [B, S/cp, H_kv, d] laid out by `lctrain.layout.sequence`, and the global
document ids [B, S] when documents are packed, and runs the configured algorithm (ring.py,
ulysses.py, usp.py, allgather.py) over the kernels of kernels.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.allgather import allgather_attention
from lctrain.attention.calls import Block
from lctrain.attention.kernels import DEFAULT_KERNEL, KernelOptions
from lctrain.attention.local import local_attention
from lctrain.attention.ring import ring_attention
from lctrain.attention.ulysses import check_heads, ulysses_attention
from lctrain.attention.usp import usp_attention
from lctrain.config import ParallelConfig, choices_of
from lctrain.layout import sequence
from lctrain.layout.comm import traffic_tag


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


class ContextParallelAttention:
    """The attention core for a cp layout: __call__(q, k, v, doc_ids=None) -> out [B, S/cp, H, d].

    The blocks (positions, and document ids when given) are described on the host and their
    kernel calls planned once: at construction without documents, once per micro-batch with
    them (the same doc_ids tensor reaches every layer, the backward and any recompute).
    """

    def __init__(self, algorithm: str, groups: CPGroups, seq_len: int, load_balance: str, *,
                 causal: bool = True, kv_replication: int = 1,
                 options: KernelOptions = DEFAULT_KERNEL):
        algorithms = choices_of(ParallelConfig, "attention")
        if algorithm not in algorithms:
            raise ValueError(f"unknown attention algorithm {algorithm!r}; use one of {algorithms}")
        sequence.check_divisible(seq_len, groups.cp_size, load_balance)
        self.algorithm, self.groups, self.seq_len = algorithm, groups, seq_len
        self.load_balance, self.causal, self.kv_replication = load_balance, causal, kv_replication
        self.options = options
        cp = groups.cp_size
        self._pos = [sequence.positions(seq_len, r, cp, load_balance) for r in range(cp)]
        u = groups.ulysses_size
        self.ulysses_degree = {"ulysses": cp, "usp": u}.get(algorithm, 1)
        """Ranks the heads are split over (1 for ring and all-gather)."""
        self._group_pos = [torch.cat(self._pos[i * u:(i + 1) * u]) for i in range(groups.ring_size)]
        self._planned_for: Tensor | None = None
        self._blocks = self._make_blocks(None)

    def _make_blocks(self, doc_ids: Tensor | None) -> tuple[Block, list[Block]]:
        """(this rank's query block, the key blocks its algorithm attends to)."""
        doc = None if doc_ids is None else doc_ids.cpu()

        def block(pos: Tensor) -> Block:
            return Block(pos, None if doc is None else doc[:, pos])

        g = self.groups
        if g.cp_size == 1:
            only = block(self._pos[0])
            return only, [only]
        if self.algorithm == "allgather":
            return block(self._pos[g.cp_rank]), [block(torch.cat(self._pos))]
        groups = [block(p) for p in self._group_pos]
        return groups[g.ring_rank], groups

    def blocks(self, doc_ids: Tensor | None) -> tuple[Block, list[Block]]:
        """The blocks for these document ids, planned once per doc_ids tensor."""
        if doc_ids is None:
            return self._blocks
        if doc_ids is not self._planned_for:
            self._planned_for, self._doc_blocks = doc_ids, self._make_blocks(doc_ids)
        return self._doc_blocks

    def attention(self, q: Tensor, k: Tensor, v: Tensor,
                  doc_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(out, lse); lse is in the layout of the algorithm's core (see each algorithm). Shapes
        and heads are checked here, once, before any collective."""
        g, local = self.groups, self.seq_len // self.groups.cp_size
        if q.shape[1] != local or k.shape[1] != local:
            raise ValueError(f"{self.algorithm} attention expects local sequence {local} "
                             f"(seq_len {self.seq_len} / cp {g.cp_size}); got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}")
        if self.ulysses_degree > 1:
            check_heads(q, k, self.ulysses_degree, self.kv_replication)
        if doc_ids is not None and doc_ids.shape[-1] != self.seq_len:
            raise ValueError(f"doc_ids must cover the global sequence ({self.seq_len} tokens); "
                             f"got {tuple(doc_ids.shape)}")
        qb, kbs = self.blocks(doc_ids)
        kw = {"causal": self.causal, "scale": 1.0 / math.sqrt(q.shape[-1]),
              "options": self.options}
        with traffic_tag(self.algorithm):
            if g.cp_size == 1:
                return local_attention(q, k, v, qb, qb, **kw)
            if self.algorithm == "allgather":
                return allgather_attention(q, k, v, qb, kbs[0], g.cp, **kw)
            if self.algorithm == "ulysses":
                return ulysses_attention(q, k, v, qb, g.ulysses,
                                         kv_replication=self.kv_replication, **kw)
            if self.algorithm == "ring":
                return ring_attention(q, k, v, qb, kbs, g.ring, **kw)
            return usp_attention(q, k, v, kbs, g.ulysses, g.ring,
                                 kv_replication=self.kv_replication, **kw)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        return self.attention(q, k, v, doc_ids)[0]
