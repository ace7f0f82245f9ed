"""The kernel calls a (query block, key block) pair decomposes into, planned once on the host.

Every context-parallel algorithm reduces to: queries at global positions q_pos attend to keys at
k_pos (causal: k_pos <= q_pos; packed documents: same document id). A `Block` describes one
operand on the host: positions and document ids as CPU tensors, so planning never waits for the
device. Positions ([S], or [B, S] when each row has its own split: load_balance=documents)
and documents cut a row's tokens into segments (consecutive positions of one document:
`lctrain.layout.segments`). A same-document (query segment, key segment) pair then splits, by
positions alone, into at most three rectangles (docs/parallelism.md §4):

    keys before the overlap of the two position ranges -> full (no mask) for the overlap queries
    the overlap itself                                  -> causal diagonal
    queries after the whole key range                   -> full

so no call ever needs an explicit mask, and rows that see no key get no call (their lse stays
-inf). A sliding window of W keys (each query sees itself and the W - 1 positions before it,
transformers' rule; causal only) clips each rectangle to what the window leaves visible: the
diagonal becomes a band, a rectangle of earlier keys loses the keys and queries too far apart,
and what is left partly visible is a `band` call, the window flash attention's kernels take
(docs/parallelism.md §25). A block caches its plan per partner: the ring's steps, the backward
and activation recompute reuse it, and a new plan is made once per micro-batch of documents.
`varlen_groups` packs the calls of a documents plan into a few variable-length batches (per
kind, in waves where no query row repeats) for flash-attn's varlen kernels: (b, position)
indices and int32 cu_seqlens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lctrain import device
from lctrain.layout.segments import Segments, expand, segments
from lctrain.layout.sequence import take

ALL_ROWS = slice(None)


class KernelCall(NamedTuple):
    """One kernel launch of a (query block, key block) pair."""

    rows: slice
    """Batch rows it covers (all of them without documents, one row with them)."""
    q: slice
    """Local query indices."""
    k: slice
    """Local key indices."""
    kind: str
    """full (every key visible) | causal (the diagonal: same positions, is_causal) | band (the
    keys inside `band`)."""
    band: tuple[int, int] | None = None
    """For kind band: flash attention's window (left, right), bottom-right aligned: query i of
    n sees key j of m iff i + m - n - left <= j <= i + m - n + right (-1: unbounded)."""


@dataclass(frozen=True, eq=False)
class VarlenGroup:
    """Calls of one kind packed for a variable-length kernel: query and key rows as flat
    indices b * S + s into [B * S] views, and cumulative sequence lengths."""

    causal: bool
    band: tuple[int, int] | None
    q_index: Tensor
    k_index: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    _on: dict = field(default_factory=dict, compare=False, repr=False)

    def on(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q_index, k_index, cu_q, cu_k) on `device`, copied once."""
        if device not in self._on:
            self._on[device] = tuple(t.to(device, non_blocking=True) for t in (
                self.q_index, self.k_index, self.cu_q, self.cu_k))
        return self._on[device]


@dataclass(frozen=True, eq=False)
class Ordered:
    """A block's tokens in position order: the permutation (and its inverse) that sorts them,
    and the sorted block. `index` is None when they are sorted already."""

    index: Tensor | None
    inverse: Tensor | None
    block: Block
    _on: dict = field(default_factory=dict, compare=False, repr=False)

    def on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(index, inverse) on `device`, copied once."""
        if device not in self._on:
            self._on[device] = (self.index.to(device, non_blocking=True),
                                self.inverse.to(device, non_blocking=True))
        return self._on[device]


@dataclass(frozen=True, eq=False)
class Block:
    """Tokens of one attention operand, on the host: global positions [S] (the same in every
    row) or [B, S] (each row its own: load_balance=documents, which needs documents), and
    optional document ids [B, S] (CPU tensors; others are copied once, here)."""

    pos: Tensor
    doc: Tensor | None = None
    _segments: dict[int, Segments] = field(default_factory=dict, compare=False, repr=False)
    """Each row's segments, found once (`segments`)."""
    _calls: dict[tuple[int, bool, int | None], tuple[Block, list]] = field(
        default_factory=dict, compare=False, repr=False)
    """(partner's id, causal, window) -> (the partner, [its calls, their varlen groups or None])
    (`_plan`; the partner is kept so that a new block at a reused id plans again)."""

    def __post_init__(self):
        object.__setattr__(self, "pos", self.pos.cpu())
        if self.doc is not None:
            object.__setattr__(self, "doc", self.doc.cpu())

    @property
    def row_pos(self) -> Tensor:
        """Positions [B, S] (a shared [S] repeated per row; needs document ids for B)."""
        return self.pos.expand_as(self.doc) if self.pos.dim() == 1 else self.pos

    @cached_property
    @device.on_host
    def ordered(self) -> Ordered:
        """This block in position order (a zigzag group's tokens become one run per stretch of
        consecutive chunks, so attention over it needs the fewest calls); per row for per-row
        positions."""
        index = torch.argsort(self.pos, dim=-1)
        if torch.equal(index, torch.arange(index.shape[-1]).expand_as(index)):
            return Ordered(None, None, self)
        pos = self.pos[index] if index.dim() == 1 else self.pos.gather(1, index)
        doc = None if self.doc is None else take(self.doc, index, 1)
        return Ordered(index, torch.argsort(index, dim=-1), Block(pos, doc))

    def segments(self, b: int) -> Segments:
        """Row `b`'s tokens as segments (consecutive positions of one document), found once."""
        if b not in self._segments:
            pos = self.pos if self.pos.dim() == 1 else self.pos[b]
            self._segments[b] = segments(pos.numpy(),
                                         None if self.doc is None else self.doc[b].numpy())
        return self._segments[b]

    def calls(self, kb: Block, causal: bool, window: int | None = None) -> list[KernelCall]:
        """The kernel calls of this block's queries against `kb`'s keys (planned once)."""
        return self._plan(kb, causal, window)[0]

    @device.on_host
    def varlen_groups(self, kb: Block, causal: bool,
                      window: int | None = None) -> list[VarlenGroup]:
        """`calls(kb, causal, window)` packed by kind (and band) for a variable-length kernel
        (planned once)."""
        plan = self._plan(kb, causal, window)
        if plan[1] is None:
            plan[1] = _pack(plan[0], self.pos.shape[-1], kb.pos.shape[-1])
        return plan[1]

    @device.on_host
    def _plan(self, kb: Block, causal: bool, window: int | None) -> list:
        key = (id(kb), causal, window)
        if key not in self._calls or self._calls[key][0] is not kb:
            self._calls[key] = (kb, [list(kernel_calls(self, kb, causal, window)), None])
        return self._calls[key][1]


class KeyBlocks(list):
    """A micro-batch's key blocks, in the order the algorithm attends them (block i: cp rank i's
    tokens where the algorithm exchanges whole ranks' blocks), and what is planned once over all
    of them, each table filled on first use by the module that plans it: the state of a
    micro-batch's plan, held where it belongs instead of in a cache keyed by object ids."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self._ordered: KeyBlocks | None = None
        self.travel: dict[bool, list | None] = {}
        """causal -> the travelling tokens of each block (`lctrain.attention.travel`)."""
        self.halo: dict[tuple[int, int], object] = {}
        """(rank, window) -> that rank's halo exchange (`lctrain.attention.halo`)."""
        self.joined: dict[tuple[int, bool], Block] = {}
        """(rank, causal) -> all-gather KV's key block of the own tokens and every other
        rank's travelling ones (`lctrain.attention.allgather`)."""
        self.all_tokens: Block | None = None
        """all-gather KV's key block of every rank's tokens, without documents."""

    @property
    def ordered(self) -> KeyBlocks:
        """The blocks in position order (`Block.ordered`), as KeyBlocks of their own: made
        once, so what is planned over them is planned once too (USP's ring)."""
        if self._ordered is None:
            self._ordered = KeyBlocks([b.ordered.block for b in self])
        return self._ordered


class PlanCache:
    """What `make(doc_ids)` plans from a micro-batch's document ids (host tensors, or None),
    kept for the last `size` micro-batches and found again by content: every layer, the
    backward, activation recompute and a pipeline stage's later passes get the same plan,
    whichever tensor object carries the ids. A hit costs an identity check, or an equality
    test of the ids (no planning)."""

    def __init__(self, make, size: int = 4):
        self.make, self.size = make, size
        self._entries: list[tuple[Tensor | None, object]] = []  # newest last

    def __call__(self, doc_ids: Tensor | None):
        for i, (ids, plan) in enumerate(self._entries):
            if ids is doc_ids or (ids is not None and doc_ids is not None
                                  and ids.shape == doc_ids.shape and torch.equal(ids, doc_ids)):
                self._entries.append(self._entries.pop(i))
                return plan
        plan = self.make(doc_ids)
        kept = self._entries[max(0, len(self._entries) + 1 - self.size):]
        self._entries = [*kept, (doc_ids, plan)]
        return plan


@device.on_host
def _local_block(seq_len: int, doc_ids: Tensor | None) -> Block:
    return Block(torch.arange(seq_len), doc_ids)


_LOCAL_BLOCKS: dict[int, PlanCache] = {}


def local_block(seq_len: int, doc_ids: Tensor | None) -> Block:
    """The block of a whole sequence of `seq_len` tokens (cp = 1) with these document ids, made
    on the host and planned once per micro-batch (not per layer)."""
    if seq_len not in _LOCAL_BLOCKS:
        _LOCAL_BLOCKS[seq_len] = PlanCache(lambda doc: _local_block(seq_len, doc))
    return _LOCAL_BLOCKS[seq_len](None if doc_ids is None else doc_ids.cpu())


FULL, CAUSAL, BAND = 0, 1, 2
KINDS = ("full", "causal", "band")


def kernel_calls(qb: Block, kb: Block, causal: bool, window: int | None = None):
    """Every kernel call of q block x kv block, in order: the decomposition the kernels run
    (public for tests and benchmarks that count work). `window`: a sliding window of that many
    keys (causal only; None: none). Each row's tokens are taken as segments (consecutive
    positions of one document) and every same-document (query, key) segment pair is cut into
    its rectangles at once, as arrays: the host's work grows with the segments, never with the
    tokens, and takes a few array operations per row however many calls come out."""
    if window is not None and not causal:
        raise ValueError("a sliding window is causal: it needs causal=True")
    if qb.doc is None and kb.doc is None:  # the same positions in every row: calls cover all
        assert qb.pos.dim() == 1 and kb.pos.dim() == 1, "per-row positions need documents"
        return _segment_calls(qb.segments(0), kb.segments(0), ALL_ROWS, causal, window)
    assert qb.doc is not None and kb.doc is not None, "both operands need document ids"
    return [call for b in range(qb.doc.shape[0])  # each row's documents attend to themselves
            for call in _segment_calls(qb.segments(b), kb.segments(b), slice(b, b + 1), causal,
                                       window)]


def _segment_calls(qs: Segments, ks: Segments, rows: slice, causal: bool,
                   window: int | None) -> list[KernelCall]:
    """The calls of one row's query segments against its key segments: per same-document pair,
    its rectangles (`_rectangles`), clipped to the window (`_in_window`), as local slices."""
    qi, ki = _same_document_pairs(qs.doc, ks.doc)
    q0, k0 = qs.start[qi], ks.start[ki]
    r = _rectangles(q0, q0 + qs.length[qi], k0, k0 + ks.length[ki], causal)
    if window is not None:
        r = _in_window(r, window)
    pair = r["pair"]
    q_local = qs.local[qi][pair] + r["q0"] - q0[pair]
    k_local = ks.local[ki][pair] + r["k0"] - k0[pair]
    columns = zip(q_local.tolist(), (q_local + r["q1"] - r["q0"]).tolist(), k_local.tolist(),
                  (k_local + r["k1"] - r["k0"]).tolist(), r["kind"].tolist(),
                  r["left"].tolist(), r["right"].tolist())
    return [KernelCall(rows, slice(qa, qb), slice(ka, kb), KINDS[kind],
                       (left, right) if kind == BAND else None)
            for qa, qb, ka, kb, kind, left, right in columns]


def _same_document_pairs(q_doc: np.ndarray, k_doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(query segment, key segment) index pairs of the same document: query segments in order,
    each one's key segments in order."""
    order = np.argsort(k_doc, kind="stable")
    first = np.searchsorted(k_doc[order], q_doc, side="left")
    count = np.searchsorted(k_doc[order], q_doc, side="right") - first
    qi = np.repeat(np.arange(len(q_doc)), count)
    offset = np.arange(len(qi)) - np.repeat(np.cumsum(count) - count, count)
    return qi, order[np.repeat(first, count) + offset]


def _rectangles(q0: np.ndarray, q1: np.ndarray, k0: np.ndarray, k1: np.ndarray,
                causal: bool) -> dict[str, np.ndarray]:
    """The mask-free rectangles of query position ranges [q0, q1) against key ranges [k0, k1),
    one pair per index: {pair, q0, q1, k0, k1, kind, left, right} arrays, by pair and then in
    the order below (docs/parallelism.md §4). Causal, with lo, hi the overlap's ends:
        keys all before the queries            -> full
        keys before the overlap [k0, lo)       -> full, for the overlap's queries
        the overlap [lo, hi) itself            -> causal diagonal
        queries after the last key [hi, q1)    -> full, every key
    and nothing when every key follows every query."""
    if not causal:
        parts = [(np.ones(len(q0), bool), (q0, q1, k0, k1), FULL)]
    else:
        before = k1 <= q0
        lo, hi = np.maximum(q0, k0), np.minimum(q1, k1)
        meet = ~before & (lo < hi)
        parts = [(before, (q0, q1, k0, k1), FULL), (meet & (k0 < lo), (lo, hi, k0, lo), FULL),
                 (meet, (lo, hi, lo, hi), CAUSAL), (meet & (q1 > k1), (hi, q1, k0, k1), FULL)]
    pair = np.concatenate([np.flatnonzero(mask) for mask, _, _ in parts])
    ends = [np.concatenate([bounds[i][mask] for mask, bounds, _ in parts]) for i in range(4)]
    kind = np.concatenate([np.full(np.count_nonzero(mask), kind) for mask, _, kind in parts])
    order = np.argsort(pair, kind="stable")  # by pair, each pair's parts in the order above
    out = dict(zip(("q0", "q1", "k0", "k1", "kind"), [v[order] for v in (*ends, kind)]))
    out["pair"] = pair[order]
    out["left"] = out["right"] = np.full(len(order), -1)
    return out


def _in_window(r: dict[str, np.ndarray], window: int) -> dict[str, np.ndarray]:
    """What a causal window of `window` keys leaves of mask-free rectangles: a diagonal longer
    than the window becomes a band (window - 1, 0); a rectangle of keys that all precede its
    queries is clipped to the queries and keys within reach (dropped when none are), full when
    its last query still sees its first key, else a band (left, unbounded): the query at p sees
    keys from p - window + 1 on."""
    q0, q1, k0, k1, kind = r["q0"], r["q1"], r["k0"], r["k1"], r["kind"]
    full = kind == FULL
    q_end = np.where(full, np.minimum(q1, k1 + window - 1), q1)
    k_start = np.where(full, np.maximum(k0, q0 - window + 1), k0)
    keep = ~full | ((q_end > q0) & (k_start < k1))
    long_diagonal = (kind == CAUSAL) & (q1 - q0 > window)
    clipped = full & (k_start < q_end - window)
    out = dict(r, q1=q_end, k0=k_start, kind=np.where(long_diagonal | clipped, BAND, kind),
               left=np.where(long_diagonal, window - 1, np.where(clipped,
                                                                  k1 - q_end + window - 1, -1)),
               right=np.where(long_diagonal, 0, -1))
    return {name: v[keep] for name, v in out.items()}


def effective_window(window: int | None, seq_len: int) -> int | None:
    """The window a layer applies over `seq_len` tokens: None (full causal attention) when it
    has none or when it covers the whole sequence."""
    return window if window is not None and window < seq_len else None


def band_rows(n: int, m: int, band: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(first, last) visible key of each of the n query rows of a band call over m keys
    ([n] each; first > last: none)."""
    left, right = band
    i = torch.arange(n)
    first = (i + m - n - left).clamp(min=0) if left >= 0 else torch.zeros(n, dtype=torch.long)
    last = (i + m - n + right).clamp(max=m - 1) if right >= 0 else torch.full((n,), m - 1)
    return first, last


def pairs_computed(calls) -> int:
    """Causal (query, key) pairs the calls compute: a causal call of q queries the triangle
    q (q + 1) / 2, a full one q x k, a band the keys inside it (what benchmarks and tests count
    work by)."""
    total = 0
    for call in calls:
        q, k = call.q.stop - call.q.start, call.k.stop - call.k.start
        if call.kind == "band":
            first, last = band_rows(q, k, call.band)
            total += int((last - first + 1).clamp(min=0).sum())
        else:
            total += q * (q + 1) // 2 if call.kind == "causal" else q * k
    return total


def _waves(calls: list[KernelCall]) -> list[list[KernelCall]]:
    """The calls in waves where no query row repeats: a varlen call merges each query row's
    result once, so a row that sees several key stretches of its document needs several."""
    waves: list[list[KernelCall]] = []
    taken: list[dict[int, list[slice]]] = []  # per wave: batch row -> query slices used

    def free(used: dict[int, list[slice]], c: KernelCall) -> bool:
        return all(c.q.stop <= s.start or s.stop <= c.q.start for s in used.get(c.rows.start, ()))

    for c in calls:
        w = next((i for i, used in enumerate(taken) if free(used, c)), None)
        if w is None:
            waves.append([])
            taken.append({})
            w = len(waves) - 1
        waves[w].append(c)
        taken[w].setdefault(c.rows.start, []).append(c.q)
    return waves


def _pack(calls: list[KernelCall], sq: int, sk: int) -> list[VarlenGroup]:
    """The calls of a documents plan (one row each) as varlen groups: per kind (and band), as
    many as it takes for no query row to repeat inside one."""
    groups = []
    for kind, band in dict.fromkeys((c.kind, c.band) for c in calls):  # in order of appearance
        for wave in _waves([c for c in calls if (c.kind, c.band) == (kind, band)]):
            row, q0, q1, k0, k1 = np.array([(c.rows.start, c.q.start, c.q.stop, c.k.start,
                                             c.k.stop) for c in wave]).T
            groups.append(VarlenGroup(
                causal=kind == "causal", band=band,
                q_index=torch.from_numpy(expand(row * sq + q0, q1 - q0)),
                k_index=torch.from_numpy(expand(row * sk + k0, k1 - k0)),
                cu_q=_cumulative(q1 - q0), cu_k=_cumulative(k1 - k0),
                max_q=int((q1 - q0).max()), max_k=int((k1 - k0).max())))
    return groups


def _cumulative(lengths: np.ndarray) -> Tensor:
    """int32 cu_seqlens of sequences of `lengths`: 0 and their running sums."""
    return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
