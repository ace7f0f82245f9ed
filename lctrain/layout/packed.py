"""What a sequence split costs on packed documents: causal work per rank and the travelling share,
counted from document lengths alone (no tensors, no processes), and packed rows drawn from a
length distribution, for the planner and the benchmarks (docs/parallelism.md §24).

Work is causal (query, key) pairs: a document's token i attends its i + 1 first tokens. A split
is each rank's [start, stop) ranges of one row (`lctrain.layout.sequence.chunk_ranges`). A
unit's token travels when another unit holds a query of its document at or after it: the most
travelling tokens of any unit, over its S/units, is the share ring and all-gather KV send.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lctrain.layout import sequence

LengthSampler = Callable[[np.random.Generator, int], np.ndarray]
"""(rng, count) -> document lengths."""


def _log_uniform(low: float, high: float) -> LengthSampler:
    return lambda rng, n: np.exp(rng.uniform(np.log(low), np.log(high), n)).astype(np.int64)


def _bimodal(rng: np.random.Generator, n: int) -> np.ndarray:
    short = rng.random(n) < 0.85
    return np.where(short, rng.uniform(128, 8192, n), rng.uniform(40960, 131072, n)).astype(
        np.int64)


LENGTH_MIXES: dict[str, LengthSampler] = {
    "loguniform": _log_uniform(256, 131072),
    "bimodal": _bimodal,
    "web": _log_uniform(100, 4096),
}
"""The document-length mixes the benchmarks and the README quote: log-uniform 256 to 128K;
85% of documents 128 to 8K and 15% 40K to 128K (most tokens in the long ones); web-like,
log-uniform 100 to 4K."""


def pack_stream(lengths: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Documents concatenated and cut every `seq_len` tokens (a document crossing a border
    continues in the next row, as a piece of its own): each full row's piece lengths."""
    rows, row, room = [], [], seq_len
    for length in lengths.tolist():
        while length > 0:
            take = min(length, room)
            row.append(take)
            length, room = length - take, room - take
            if room == 0:
                rows.append(np.array(row, dtype=np.int64))
                row, room = [], seq_len
    return rows


def sample_rows(sampler: LengthSampler, seq_len: int, rows: int, seed: int) -> list[np.ndarray]:
    """`rows` packed rows of documents drawn from `sampler` (stream packing)."""
    rng, drawn, total = np.random.default_rng(seed), [], 0
    while total < rows * seq_len:
        lengths = np.maximum(sampler(rng, 256), 1)
        drawn.append(lengths)
        total += int(lengths.sum())
    return pack_stream(np.concatenate(drawn), seq_len)[:rows]


def causal_work(lengths: np.ndarray, ranges: list[tuple[int, int]]) -> int:
    """Causal pairs of the queries in `ranges` of a row of documents `lengths`."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = 0
    for a, b in ranges:
        first, last = np.searchsorted(ends, a, side="right"), np.searchsorted(ends, b - 1,
                                                                              side="right")
        for d in range(int(first), int(last) + 1):
            lo, hi = max(a, int(starts[d])) - int(starts[d]), min(b, int(ends[d])) - int(starts[d])
            total += sequence.causal_pairs(lo, hi)
    return total


def travelling_tokens(lengths: np.ndarray, units: list[list[tuple[int, int]]],
                      causal: bool = True) -> int:
    """The most tokens of one unit that another unit's queries attend (same document; causal:
    at or after them)."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    owner = np.empty(int(np.sum(lengths)), dtype=np.int64)
    for u, ranges in enumerate(units):
        for a, b in ranges:
            owner[a:b] = u
    most = 0
    for u, ranges in enumerate(units):
        held = np.concatenate([np.arange(a, b) for a, b in ranges])
        others = np.flatnonzero(owner != u)
        # latest position of each document on the other units (-1: none)
        latest = np.full(len(lengths), -1, dtype=np.int64)
        np.maximum.at(latest, doc[others], others)
        seen = latest[doc[held]]
        most = max(most, int(np.sum(seen >= held if causal else seen >= 0)))
    return most


@dataclass(frozen=True)
class SplitCost:
    """One split of one row: causal work per unit and the travelling share."""

    work: np.ndarray
    travelling: int
    """n: the most travelling tokens of one unit."""
    per_unit: int
    """S/units."""

    @property
    def max_over_mean(self) -> float:
        return float(self.work.max() / self.work.mean())

    @property
    def share(self) -> float:
        return self.travelling / self.per_unit


def split_cost(lengths: np.ndarray, cp: int, load_balance: str, ulysses: int = 1) -> SplitCost:
    """The cost of splitting the row `lengths` over `cp` ranks whose groups of `ulysses`
    consecutive ranks attend as one unit (USP's ring groups; 1 for ring and all-gather KV;
    cp for Ulysses, whose single unit holds every token)."""
    seq_len = int(np.sum(lengths))
    units = [[r for rank in range(g * ulysses, (g + 1) * ulysses)
              for r in sequence.chunk_ranges(seq_len, rank, cp, load_balance, lengths, ulysses)]
             for g in range(cp // ulysses)]
    work = np.array([causal_work(lengths, r) for r in units], dtype=np.float64)
    travelling = travelling_tokens(lengths, units) if len(units) > 1 else 0
    return SplitCost(work, travelling, seq_len // len(units))
