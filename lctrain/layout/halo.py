"""Which tokens a window layer moves between ranks: the halo of each balance unit (docs/
parallelism.md §25), the rule in one place.

A causal window of W keys lets a query at position p see the keys at p - W + 1 .. p (of its own
document, with packed documents). A token of unit j is needed by unit i exactly when i holds a
query of the same document at most W - 1 positions after it. `needed` finds those tokens from
the two blocks' segments; the attention's halo exchange (`lctrain.attention.halo`) sends exactly
them, and `halo_tokens` counts them per unit for the plan, from the same split the loader uses.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from torch import Tensor

from lctrain.config.load_balances import split_of
from lctrain.layout.segments import Axis, Segments, covered, segments, window_intervals
from lctrain.layout.sequence import positions


def needed(keys: Segments, queries: Segments, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(first local index, length) of each stretch of `keys`' tokens (one row's segments) that a
    query of `queries` sees through a causal window of `window` keys: its document's, at most
    window - 1 positions before it; ascending by local index. Found per segment
    (`lctrain.layout.segments.window_intervals`, `covered`), never token by token."""
    axis = Axis(low=int(min(keys.doc.min(), queries.doc.min())),
                span=int(max(keys.end.max(), queries.end.max())) + window)
    return covered(keys, axis, *window_intervals(queries, axis, window))


def halo_tokens(seq_len: int, cp: int, window: int, load_balance: str, ulysses: int = 1,
                doc_ids: Tensor | None = None) -> list[tuple[int, int]]:
    """(tokens sent, tokens received) of each balance unit (ring group; a rank when ulysses =
    1) in one window layer: per pair of units, the most tokens any row needs, summed over the
    other units. The forward sends K/V of the first; the backward sends back the dK/dV of the
    second. The same split as the loader's (`lctrain.layout.sequence.positions`)."""
    units = cp // ulysses
    pos = [torch.cat([positions(seq_len, r, cp, load_balance, doc_ids=doc_ids, ulysses=ulysses)
                      for r in range(i * ulysses, (i + 1) * ulysses)], dim=-1)
           for i in range(units)]
    docs = [None if doc_ids is None else torch.gather(doc_ids, 1, p.expand(doc_ids.shape[0], -1))
            for p in pos]
    rows = 1 if doc_ids is None else doc_ids.shape[0]
    segs = [[segments((p if p.dim() == 1 else p[b]).numpy(),
                      None if d is None else d[b].numpy()) for b in range(rows)]
            for p, d in zip(pos, docs)]
    pairs = [[0 if i == j else max(int(needed(segs[j][b], segs[i][b], window)[1].sum())
                                   for b in range(rows)) for i in range(units)]
             for j in range(units)]
    return [(sum(pairs[j]), sum(row[j] for row in pairs)) for j in range(units)]


@cache  # the plan and its layout search ask for the same layouts many times
def unit_halo(seq_len: int, cp: int, window: int, load_balance: str,
              ulysses: int = 1) -> tuple[int, int]:
    """(sent, received) tokens of balance unit 0 (the rank that logs) in a window layer over
    one sequence; load_balance=documents splits it as one document (packed documents only cut
    windows shorter: an upper bound)."""
    doc_ids = torch.zeros(1, seq_len, dtype=torch.long) if split_of(load_balance).per_row else None
    return halo_tokens(seq_len, cp, window, load_balance, ulysses, doc_ids)[0]
