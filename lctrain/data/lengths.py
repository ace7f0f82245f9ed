"""Length-aware data for context extension: the documents of an epoch chosen by length bucket
(`data.length_mix`), and best-fit packing (`data.packing=best_fit`), which keeps every document
that fits a sequence whole in one.

Length mix. Bucket b holds the documents of (max_len of the bucket before, max_len] tokens and
should supply the share w_b of the epoch's tokens (weights normalised). With T tokens in all and
T_b in bucket b, each document of b is taken f_b = w_b T / T_b times: floor(f_b) times each, and
once more for a seeded choice of round(frac(f_b) n_b) of its n_b documents. f_b > 1 upsamples the
bucket (long documents, for context extension), f_b < 1 caps it. The epoch keeps about T tokens;
the choice is drawn once, so every epoch has the same documents, reshuffled.

Best-fit packing. Documents are placed longest first, each into the open sequence whose free room
(of S + 1 tokens) it fills best, a new one when none has room; a document longer than S + 1 is cut
into S + 1-token pieces first (the only documents cut). Each epoch shuffles the sequences. The
stream packing of `lctrain.data.packing` instead cuts the concatenated documents every S tokens,
so most documents longer than a few hundred tokens cross a border: `cut_fraction` measures both.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BucketStats:
    """One bucket of a length mix: its bounds, weight, and what the epoch takes from it."""

    low: int
    """Documents longer than this..."""
    high: int | None
    """...and at most this long (None: no bound)."""
    weight: float
    """Share of the epoch's tokens asked for (normalised)."""
    documents: int
    tokens: int
    """Documents and tokens of the bucket in the corpus."""
    taken_documents: int
    taken_tokens: int
    """Documents and tokens of the bucket in one epoch (repeats counted)."""

    def as_dict(self) -> dict:
        return {"max_len": self.high, "weight": round(self.weight, 12),
                "documents": self.documents, "tokens": self.tokens,
                "epoch_documents": self.taken_documents, "epoch_tokens": self.taken_tokens}


def bucket_of(lengths: np.ndarray, bounds: list[int | None]) -> np.ndarray:
    """The bucket index of each document length (bounds ascending, the last may be None)."""
    finite = np.array([b for b in bounds if b is not None], dtype=np.int64)
    return np.searchsorted(finite, lengths, side="left")


def mix_documents(docs: np.ndarray, lengths: np.ndarray, bounds: list[int | None],
                  weights: list[float], seed: int) -> tuple[np.ndarray, list[BucketStats]]:
    """(the epoch's documents, with repeats, per bucket: the stats) of `docs` whose lengths are
    `lengths[docs]`. A ValueError names a bucket that holds no document."""
    weights = np.asarray(weights, dtype=np.float64) / sum(weights)
    own = lengths[docs]
    buckets = bucket_of(own, bounds)
    total = int(own.sum())
    rng = np.random.default_rng([seed, 0x1E46])
    chosen, stats, low = [], [], 0
    for b, (high, weight) in enumerate(zip(bounds, weights)):
        members = docs[buckets == b]
        if not len(members):
            raise ValueError(f"data.length_mix[{b}] (documents of {low + 1} to "
                             f"{high if high is not None else 'any number of'} tokens) holds no "
                             "document of this corpus; drop the bucket or move its max_len")
        tokens = int(lengths[members].sum())
        factor = weight * total / tokens
        whole, extra = int(factor), round((factor - int(factor)) * len(members))
        picked = np.concatenate([np.tile(members, whole),
                                 np.sort(rng.choice(members, size=extra, replace=False))])
        chosen.append(picked)
        stats.append(BucketStats(low, high, float(weight), len(members), tokens, len(picked),
                                 int(lengths[picked].sum())))
        low = high if high is not None else low
    return np.concatenate(chosen).astype(np.int64), stats


def best_fit_bins(lengths: np.ndarray, capacity: int) -> list[list[tuple[int, int, int]]]:
    """Best-fit decreasing: sequences of (item, start, length) pieces whose lengths sum to at
    most `capacity`; item i has `lengths[i]` tokens, and one longer than `capacity` is first cut
    into `capacity`-token pieces (its last piece packed like any short item)."""
    items = []  # (length, item, start)
    for i, n in enumerate(lengths.tolist()):
        start = 0
        while n - start > capacity:
            items.append((capacity, i, start))
            start += capacity
        items.append((n - start, i, start))
    items.sort(key=lambda x: (-x[0], x[1], x[2]))
    bins: list[list[tuple[int, int, int]]] = []
    free: list[tuple[int, int]] = []  # (room left, bin id), ascending
    for n, i, start in items:
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            bins.append([(i, start, n)])
            bisect.insort(free, (capacity - n, len(bins) - 1))
            continue
        room, b = free.pop(k)
        bins[b].append((i, start, n))
        bisect.insort(free, (room - n, b))
    return bins


def stream_cut_fraction(lengths: np.ndarray, seq_len: int) -> float:
    """Share of the tokens whose document crosses a window border when `lengths` are
    concatenated in this order and cut every seq_len tokens (windows of seq_len + 1 tokens, one
    shared): a document is whole when it ends within the window its first token starts."""
    ends = np.cumsum(lengths)
    begins = ends - lengths
    whole = ends <= begins // seq_len * seq_len + seq_len + 1
    return float(lengths[~whole].sum() / max(1, lengths.sum()))


def best_fit_cut_fraction(lengths: np.ndarray, seq_len: int) -> float:
    """Share of the tokens whose document best-fit packing cuts: those longer than S + 1."""
    return float(lengths[lengths > seq_len + 1].sum() / max(1, lengths.sum()))
