"""Which tokens a window layer moves between ranks: the halo of each balance unit (docs/
parallelism.md §25).

A causal window of W keys lets a query at position p see the keys at p - W + 1 .. p (of its own
document, with packed documents). A token of unit j is needed by unit i exactly when i holds a
query of the same document at most W - 1 positions after it. `window_needed` marks those tokens;
the attention's halo exchange (`lctrain.attention.halo`) sends exactly them, and `halo_tokens`
counts them per unit for the plan and the tests, from the same split the loader uses.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from lctrain.config.load_balances import split_of
from lctrain.layout.sequence import positions


def window_needed(key_pos: Tensor, key_doc: Tensor | None, query_pos: Tensor,
                  query_doc: Tensor | None, window: int) -> Tensor:
    """[R, Sk] bool: which keys some query sees through a causal window of `window` keys.
    Positions [S] or [B, S]; documents [B, S] or None (then R = 1 row of shared positions)."""
    kp, kd = _rows(key_pos, key_doc)
    qp, qd = _rows(query_pos, query_doc)
    low = min(int(kd.min()), int(qd.min()))
    span = int(max(kp.max(), qp.max())) + window + 1
    queries = window_keys(query_pos, query_doc, low, span).sort(dim=1).values
    return needed_by(queries, window_keys(key_pos, key_doc, low, span), window)


def window_keys(pos: Tensor, doc: Tensor | None, low: int, span: int) -> Tensor:
    """[R, S] (document, position) as one sortable integer, (doc - low) x span + position: two
    tokens' keys differ by less than `span` only within one document, for documents from `low`
    on and positions below span - window."""
    p, d = _rows(pos, doc)
    return (d - low) * span + p


def needed_by(sorted_query_keys: Tensor, token_keys: Tensor, window: int) -> Tensor:
    """[R, Sk] bool: the tokens (`window_keys`) some query (its keys sorted per row) sees
    through a causal window of `window` keys: the first query at or after a token is at most
    window - 1 positions after it, in its document."""
    at = torch.searchsorted(sorted_query_keys, token_keys)
    first = sorted_query_keys.gather(1, at.clamp(max=sorted_query_keys.shape[1] - 1))
    return (at < sorted_query_keys.shape[1]) & (first < token_keys + window)


def _rows(pos: Tensor, doc: Tensor | None) -> tuple[Tensor, Tensor]:
    """(positions, documents) [R, S]: R = B with documents, one shared row without."""
    if doc is None:
        return pos.reshape(1, -1), torch.zeros(1, pos.shape[-1], dtype=torch.long)
    return pos.expand_as(doc), doc


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
    pairs = [[0 if i == j else int(window_needed(pos[j], docs[j], pos[i], docs[i], window)
                                   .sum(1).max()) for i in range(units)] for j in range(units)]
    return [(sum(pairs[j]), sum(row[j] for row in pairs)) for j in range(units)]


@cache  # the plan and its layout search ask for the same layouts many times
def unit_halo(seq_len: int, cp: int, window: int, load_balance: str,
              ulysses: int = 1) -> tuple[int, int]:
    """(sent, received) tokens of balance unit 0 (the rank that logs) in a window layer over
    one sequence; load_balance=documents splits it as one document (packed documents only cut
    windows shorter: an upper bound)."""
    doc_ids = torch.zeros(1, seq_len, dtype=torch.long) if split_of(load_balance).per_row else None
    return halo_tokens(seq_len, cp, window, load_balance, ulysses, doc_ids)[0]
