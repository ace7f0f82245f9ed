"""A block's tokens as segments, and what of them other ranks need, found by interval
arithmetic instead of token by token (docs/parallelism.md §24, §25).

A rank's tokens of one packed row are few stretches of consecutive positions (the chunks of
its split) cut further by document boundaries: a *segment* is a maximal run of local tokens
whose positions are consecutive and whose document is one. Every question the CP attention's
host plan asks of a block's tokens (which travel to other ranks, which a window layer's halo
sends) depends only on positions and documents, so it is answered per segment: a few dozen
per row where a token-by-token answer touches S/cp tokens, and the tokens come out as ranges of
local indices.

Positions and documents share one axis: a token at position p of document d sits at
(d - low) x span + p, span > S + window, so intervals of different documents never meet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segments:
    """One row's tokens as segments, in local order: each its first local index, first
    position, length and document (0 without documents)."""

    local: np.ndarray
    start: np.ndarray
    length: np.ndarray
    doc: np.ndarray

    @property
    def end(self) -> np.ndarray:
        """Positions just after each segment."""
        return self.start + self.length


def segments(pos: np.ndarray, doc: np.ndarray | None) -> Segments:
    """The segments of one row's positions [n] and documents [n] (None: one document)."""
    cut = np.diff(pos) != 1
    if doc is not None:
        cut |= np.diff(doc) != 0
    local = np.concatenate([[0], np.flatnonzero(cut) + 1]) if len(pos) else np.zeros(0, int)
    length = np.diff(np.concatenate([local, [len(pos)]]))
    docs = np.zeros(len(local), dtype=np.int64) if doc is None else doc[local]
    return Segments(local, pos[local], length, docs)


@dataclass(frozen=True)
class Axis:
    """The shared (document, position) axis of one row: `low`, the smallest document id, and
    `span`, more than any position plus the window."""

    low: int
    span: int

    def at(self, doc: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return (doc - self.low) * self.span + pos


def window_intervals(queries: Segments, axis: Axis, window: int) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi) on the axis, disjoint and ascending: the keys some query of `queries` sees
    through a causal window of `window` keys that are not at or after a query of its segment.
    A segment starting at position a in document d reaches back to a - window + 1 in d; every
    key from there to a is seen by the query at a (the nearest, within window - 1), and a key
    further back by none (a later query is further still). Keys of the segment itself are the
    queries' own positions, which no other rank holds."""
    hi = axis.at(queries.doc, queries.start)
    return merged(hi - (window - 1), hi)


def merged(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [lo, hi) as disjoint ascending intervals (empty ones dropped)."""
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    if len(lo) == 0:
        return lo, hi
    reach = np.maximum.accumulate(hi)
    new = np.concatenate([[True], lo[1:] > reach[:-1]])
    starts = np.flatnonzero(new)
    ends = np.concatenate([starts[1:], [len(lo)]]) - 1
    return lo[starts], reach[ends]


def covered(keys: Segments, axis: Axis, lo: np.ndarray, hi: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """(first local index, length) of each stretch of `keys`' tokens inside the disjoint
    ascending axis intervals [lo, hi), ascending by local index."""
    k_lo = axis.at(keys.doc, keys.start)
    order = np.argsort(k_lo, kind="stable")
    k_lo, k_hi, k_local = k_lo[order], k_lo[order] + keys.length[order], keys.local[order]
    # for each segment, the intervals it meets: from the first ending after its start, as
    # many as start before its end
    first = np.searchsorted(hi, k_lo, side="right")
    count = np.maximum(np.searchsorted(lo, k_hi, side="left") - first, 0)
    seg = np.repeat(np.arange(len(k_lo)), count)
    pair = first[seg] + np.arange(len(seg)) - np.repeat(np.cumsum(count) - count, count)
    a = np.maximum(k_lo[seg], lo[pair])
    b = np.minimum(k_hi[seg], hi[pair])
    local = k_local[seg] + (a - k_lo[seg])
    order = np.argsort(local, kind="stable")
    return local[order], (b - a)[order]


def prefixes(keys: Segments, latest: np.ndarray, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(first local index, length) of each segment's tokens that a query elsewhere sees: its
    document's latest position held elsewhere is `latest[segment]` (-1: none); causal, the
    tokens at or before it, else all of them once any is held."""
    if causal:
        length = np.clip(latest + 1 - keys.start, 0, keys.length)
    else:
        length = np.where(latest >= 0, keys.length, 0)
    keep = length > 0
    return keys.local[keep], length[keep]


def expand(first: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The local indices of stretches (first, length), concatenated in order."""
    total = int(length.sum())
    shift = first - (np.cumsum(length) - length)  # first - offset in the output
    return np.arange(total) + np.repeat(shift, length)
