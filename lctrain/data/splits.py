"""Held-out validation documents: a seeded split of a preprocessed dataset's documents into a
training part and a validation part that never meet (data.val_fraction)."""

from __future__ import annotations

import numpy as np

from lctrain.data.shards import TokenStore


def held_out(store: TokenStore, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training documents, validation documents) of `store`: each document goes to validation
    with probability `fraction`, decided by (seed, document index) alone, so the split is the
    same in every run and on every rank. At least one document is held out when fraction > 0."""
    draw = np.random.default_rng([seed, 0x7A11D]).random(store.num_documents)
    val = draw < fraction
    if fraction > 0 and not val.any():
        val[int(np.argmin(draw))] = True
    return np.flatnonzero(~val), np.flatnonzero(val)
