"""Context-parallel attention: one contract, one shared (out, lse) merge, one file per algorithm.

`ContextParallelAttention` is the attention core the model calls: it receives the local shards
q [B, S/cp, H, d], k/v [B, S/cp, H_kv, d] laid out by `lctrain.layout.sequence`, and the global
document ids [B, S] when documents are packed, and runs the configured algorithm over the
kernels of kernels.py. It asks two registries, both keyed by the algorithm's name: the facts in
`lctrain.config.cp_algorithms` (which the layout's groups follow) and the implementation in
algorithms.py (its blocks and its function). The implementations are registered here, one line each
(docs/extending.md).
"""

from __future__ import annotations

import math

from torch import Tensor

from lctrain import device
from lctrain.attention.algorithms import CP_ATTENTION, CPGroups, register, registered
from lctrain.attention.allgather import ALLGATHER
from lctrain.attention.calls import Block, KeyBlocks, PlanCache, effective_window
from lctrain.attention.kernels import DEFAULT_KERNEL, KernelOptions
from lctrain.attention.local import local_attention
from lctrain.attention.ring import RING
from lctrain.attention.ulysses import ULYSSES, check_heads
from lctrain.attention.usp import USP
from lctrain.comm import traffic_tag
from lctrain.config.load_balances import split_of
from lctrain.layout import sequence

for _entry in (ULYSSES, RING, USP, ALLGATHER):
    register(_entry)

__all__ = ["CP_ATTENTION", "CPGroups", "ContextParallelAttention", "registered"]


class ContextParallelAttention:
    """The attention core for a cp layout: __call__(q, k, v, doc_ids=None) -> out [B, S/cp, H, d].

    The blocks (positions, and document ids when given) are described on the host and their
    kernel calls planned once: at construction without documents, once per micro-batch with
    them (found again by content for every layer, the backward and any recompute). With
    load_balance=documents the positions themselves come from each micro-batch's documents
    (`lctrain.layout.sequence`, balanced per row over the algorithm's balance units: its ring
    groups).
    """

    def __init__(self, algorithm: str, groups: CPGroups, seq_len: int, load_balance: str, *,
                 causal: bool = True, kv_replication: int = 1,
                 options: KernelOptions = DEFAULT_KERNEL):
        if algorithm not in CP_ATTENTION:
            raise ValueError(f"unknown attention algorithm {algorithm!r}; use one of "
                             f"{tuple(CP_ATTENTION)}")
        sequence.check_divisible(seq_len, groups.cp_size, load_balance)
        self.algorithm, self.groups, self.seq_len = algorithm, groups, seq_len
        self.load_balance, self.causal, self.kv_replication = load_balance, causal, kv_replication
        self.options = options
        self._run = CP_ATTENTION[algorithm]
        self.ulysses_degree = groups.ulysses_size
        """Ranks the heads are split over: the groups' Ulysses size, which the layout
        (`lctrain.config.derived.ulysses_degree`) sets from the algorithm (1 for ring and
        all-gather)."""
        # without a per-row split every micro-batch's blocks share their positions: made once
        self._fixed_pos = None if self.per_row else self._block_positions(None)
        self._blocks = None if self.per_row else self._make_blocks(None)
        self._doc_blocks = PlanCache(self._make_blocks)

    @property
    def per_row(self) -> bool:
        """Whether each micro-batch row has its own split (load_balance=documents, cp > 1)."""
        return split_of(self.load_balance).per_row and self.groups.cp_size > 1

    def rank_positions(self, doc_ids: Tensor | None) -> list[Tensor]:
        """Global positions of every cp rank's tokens ([S/cp], or [B, S/cp] per row)."""
        cp = self.groups.cp_size
        return sequence.every_rank_positions(self.seq_len, cp, self.load_balance, doc_ids,
                                             self.ulysses_degree)

    def _block_positions(self, doc_ids: Tensor | None) -> tuple[Tensor, list[Tensor]]:
        """Positions of this rank's query block and of the key blocks it attends to."""
        pos = self.rank_positions(doc_ids)
        return (pos[0], [pos[0]]) if len(pos) == 1 else self._run.blocks(pos, self.groups)

    def _make_blocks(self, doc_ids: Tensor | None) -> tuple[Block, KeyBlocks]:
        """(this rank's query block, the key blocks its algorithm attends to)."""
        doc = None if doc_ids is None else doc_ids.cpu()
        query, keys = self._fixed_pos or self._block_positions(doc)
        made: dict[int, Block] = {}

        def block(p: Tensor) -> Block:  # one Block per positions tensor: planned once
            if id(p) not in made:
                made[id(p)] = Block(p, None if doc is None else sequence.take(doc, p, 1))
            return made[id(p)]

        return block(query), KeyBlocks([block(p) for p in keys])

    @device.on_host
    def blocks(self, doc_ids: Tensor | None) -> tuple[Block, KeyBlocks]:
        """The blocks for these document ids, planned once per micro-batch (`PlanCache`)."""
        if doc_ids is None:
            if self._blocks is None:
                raise ValueError("load_balance=documents splits each row by its documents: "
                                 "the attention needs the document ids (data.document_masking"
                                 "=true), or use parallel.load_balance=zigzag")
            return self._blocks
        return self._doc_blocks(doc_ids)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None,
                  window: int | None = None,
                  sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(out, lse); lse is in the layout of the algorithm's core (see each algorithm). Shapes
        and heads are checked here, once, before any collective. `window`: a sliding window of
        that many keys (a window layer; one at least the sequence is full attention); `sink`:
        attention sinks, a logit per query head [H] that every query's softmax denominator
        adds (None: none; docs/parallelism.md §26)."""
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
        if window is not None and window < 1:
            raise ValueError(f"a sliding window holds at least 1 key; got {window}")
        if window is not None and not self.causal:
            raise ValueError("a sliding window is causal: it needs causal attention")
        if sink is not None and tuple(sink.shape) != (q.shape[2],):
            raise ValueError(f"attention sinks hold one logit per query head ({q.shape[2]}); "
                             f"got {tuple(sink.shape)}")
        qb, kbs = self.blocks(doc_ids)
        kw = {"causal": self.causal, "scale": 1.0 / math.sqrt(q.shape[-1]),
              "options": self.options,
              "window": effective_window(window, self.seq_len), "sink": sink}
        with traffic_tag(self.algorithm):
            if g.cp_size == 1:
                return local_attention(q, k, v, qb, qb, **kw)
            return self._run.attend(q, k, v, qb, kbs, g, kv_replication=self.kv_replication,
                                    **kw)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None,
                 window: int | None = None, sink: Tensor | None = None) -> Tensor:
        return self.attention(q, k, v, doc_ids, window, sink)[0]
