"""The kernel calls a (query block, key block) pair decomposes into, planned once on the host.

Every context-parallel algorithm reduces to: queries at global positions q_pos attend to keys at
k_pos (causal: k_pos <= q_pos; packed documents: same document id). A `Block` describes one
operand on the host: positions and document ids as CPU tensors, so planning never waits for the
device. Positions ([S], or [B, S] when each row has its own split: load_balance=documents)
form runs of consecutive values (`lctrain.layout.sequence.Run`); documents cut each run into
same-document stretches. A (query stretch, key stretch) pair then splits, by
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

import torch
from torch import Tensor

from lctrain import device
from lctrain.layout.segments import Segments, segments
from lctrain.layout.sequence import Run, runs, take

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
    _plans: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "pos", self.pos.cpu())
        if self.doc is not None:
            object.__setattr__(self, "doc", self.doc.cpu())

    @cached_property
    @device.on_host
    def runs(self) -> list[Run]:
        """Runs of positions [S] shared by every row (not for per-row positions)."""
        assert self.pos.dim() == 1, "per-row positions: use row_runs"
        return runs(self.pos)

    @cached_property
    @device.on_host
    def _row_runs(self) -> list[list[Run]]:
        return [runs(p) for p in self.pos]

    @property
    def row_pos(self) -> Tensor:
        """Positions [B, S] (a shared [S] repeated per row; needs document ids for B)."""
        return self.pos.expand_as(self.doc) if self.pos.dim() == 1 else self.pos

    def row_runs(self, b: int) -> list[Run]:
        """Runs of the positions of batch row `b`."""
        return self.runs if self.pos.dim() == 1 else self._row_runs[b]

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

    def stretches(self, b: int, run: Run) -> dict[int, list[tuple[int, int]]]:
        """Row `b`'s documents inside `run`: {id: [(offset in the run, length), ...]}, found
        once per (row, run) however many partners' plans ask (`_stretches`)."""
        key = ("stretches", b, run)
        if key not in self._plans:
            self._plans[key] = _stretches(self.doc[b, run.rows])
        return self._plans[key]

    def segments(self, b: int) -> Segments:
        """Row `b`'s tokens as segments (consecutive positions of one document), found once."""
        key = ("segments", b)
        if key not in self._plans:
            pos = self.pos if self.pos.dim() == 1 else self.pos[b]
            self._plans[key] = segments(pos.numpy(),
                                        None if self.doc is None else self.doc[b].numpy())
        return self._plans[key]

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
        if key not in self._plans or self._plans[key][0] is not kb:
            self._plans[key] = (kb, [list(kernel_calls(self, kb, causal, window)), None])
        return self._plans[key][1]


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


def _rectangles(qr: Run, kr: Run, causal: bool, window: int | None):
    """(query run, key run, kind, band) rectangles of a query run against a key run."""
    for q, k, kind in _causal_rectangles(qr, kr, causal):
        if window is None:
            yield q, k, kind, None
        else:
            yield from _in_window(q, k, kind, window)


def _in_window(q: Run, k: Run, kind: str, window: int):
    """What a causal window of `window` keys leaves of a mask-free rectangle: the diagonal
    (kind causal) as it is or as a band, or a rectangle of keys that all precede its queries
    clipped to the queries and keys within reach, full or as a band."""
    if kind == "causal":  # q and k are the same positions
        yield (q, k, "causal", None) if q.length <= window else (q, k, "band", (window - 1, 0))
        return
    q_end, k_start = min(q.end, k.end + window - 1), max(k.start, q.start - window + 1)
    if q_end <= q.start or k_start >= k.end:  # every query too far from every key
        return
    qw, kw = q.part(0, q_end - q.start), k.part(k_start - k.start, k.end - k_start)
    if k_start >= q_end - window:  # the last query still sees the first key: all visible
        yield qw, kw, "full", None
    else:  # query at p sees keys from p - window + 1 on: (left, unbounded)
        yield qw, kw, "band", (k.end - q_end + window - 1, -1)


def _causal_rectangles(qr: Run, kr: Run, causal: bool):
    """(query run, key run, kind) rectangles of a query run against a key run, mask-free."""
    if not causal or kr.end <= qr.start:
        yield qr, kr, "full"
        return
    lo, hi = max(qr.start, kr.start), min(qr.end, kr.end)
    if lo >= hi:  # every key after every query
        return
    overlap_q = qr.part(lo - qr.start, hi - lo)
    if kr.start < lo:  # keys before the overlap: all visible to the overlap's queries
        yield overlap_q, kr.part(0, lo - kr.start), "full"
    yield overlap_q, kr.part(lo - kr.start, hi - lo), "causal"
    if qr.end > kr.end:  # queries after the last key see every key
        yield qr.part(hi - qr.start, qr.end - hi), kr, "full"


def _stretches(doc: Tensor) -> dict[int, list[tuple[int, int]]]:
    """{document id: [(offset, length), ...]} of the maximal same-id stretches of a run [n]."""
    ids, counts = torch.unique_consecutive(doc, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    out: dict[int, list[tuple[int, int]]] = {}
    for d, s, n in zip(ids.tolist(), starts.tolist(), counts.tolist()):
        out.setdefault(d, []).append((s, n))
    return out


def kernel_calls(qb: Block, kb: Block, causal: bool, window: int | None = None):
    """Every kernel call of q block x kv block, in order: the decomposition the kernels run
    (public for tests and benchmarks that count work). `window`: a sliding window of that many
    keys (causal only; None: none)."""
    if window is not None and not causal:
        raise ValueError("a sliding window is causal: it needs causal=True")
    if qb.pos.dim() == 2 or kb.pos.dim() == 2:  # each row its own split
        assert qb.doc is not None and kb.doc is not None, "per-row positions need documents"
        for b in range(qb.doc.shape[0]):
            for q_run in qb.row_runs(b):
                for k_run in kb.row_runs(b):
                    if not _out_of_reach(q_run, k_run, causal, window):
                        yield from _document_calls(qb, kb, b, q_run, k_run, causal, window)
        return
    for q_run in qb.runs:
        for k_run in kb.runs:
            if qb.doc is None:
                for qr, kr, kind, band in _rectangles(q_run, k_run, causal, window):
                    yield KernelCall(ALL_ROWS, qr.rows, kr.rows, kind, band)
                continue
            for b in range(qb.doc.shape[0]):  # each row's documents attend only to themselves
                yield from _document_calls(qb, kb, b, q_run, k_run, causal, window)


def _out_of_reach(q_run: Run, k_run: Run, causal: bool, window: int | None) -> bool:
    """Whether no query of `q_run` sees a key of `k_run` by positions alone (every key after
    every query, or further back than the window): no need to look at their documents."""
    if not causal:
        return False
    return k_run.start >= q_run.end or (window is not None
                                        and k_run.end <= q_run.start - window + 1)


def _document_calls(qb: Block, kb: Block, b: int, q_run: Run, k_run: Run, causal: bool,
                    window: int | None):
    """The calls of row `b`'s query run against its key run: each document only to itself."""
    row = slice(b, b + 1)
    q_docs, k_docs = qb.stretches(b, q_run), kb.stretches(b, k_run)
    for d, q_pieces in q_docs.items():
        for qo, ql in q_pieces:
            for ko, kl in k_docs.get(d, ()):
                for qr, kr, kind, band in _rectangles(q_run.part(qo, ql), k_run.part(ko, kl),
                                                      causal, window):
                    yield KernelCall(row, qr.rows, kr.rows, kind, band)


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
            q_idx = [torch.arange(c.q.start, c.q.stop) + c.rows.start * sq for c in wave]
            k_idx = [torch.arange(c.k.start, c.k.stop) + c.rows.start * sk for c in wave]
            q_len = torch.tensor([len(i) for i in q_idx])
            k_len = torch.tensor([len(i) for i in k_idx])
            groups.append(VarlenGroup(
                causal=kind == "causal", band=band, q_index=torch.cat(q_idx),
                k_index=torch.cat(k_idx),
                cu_q=torch.cat([torch.zeros(1, dtype=torch.int32), q_len.cumsum(0).int()]),
                cu_k=torch.cat([torch.zeros(1, dtype=torch.int32), k_len.cumsum(0).int()]),
                max_q=int(q_len.max()), max_k=int(k_len.max())))
    return groups
