"""The host plans made from segments (lctrain.layout.segments: interval arithmetic over runs of
consecutive positions of one document) against token-by-token answers: the halo a window
layer exchanges (against `tests.reference.window_needed`, which compares every key with
every query's document and position) and the tokens Ring and all-gather KV send (against a
brute-force count of the latest query elsewhere of each token's document), on random packed
rows of mixed lengths, zigzag and documents splits, windows shorter and longer than the
documents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lctrain.attention.calls import Block, KeyBlocks
from lctrain.attention.halo import halo_plan
from lctrain.attention.travel import travel_plan
from lctrain.layout import sequence
from lctrain.layout.segments import merged
from tests.reference import window_needed


def _rows(rng, rows: int, seq_len: int) -> torch.Tensor:
    """[rows, S] document ids of random packed rows (ids continuing across rows, as the
    loader's)."""
    out, next_id = [], 3
    for _ in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), rng.integers(1, 9), replace=False))
        lengths = np.diff([0, *cuts, seq_len])
        out.append(np.repeat(np.arange(next_id, next_id + len(lengths)), lengths))
        next_id += len(lengths)
    return torch.from_numpy(np.stack(out))


def _blocks(seq_len: int, cp: int, balance: str, doc: torch.Tensor | None) -> KeyBlocks:
    pos = sequence.every_rank_positions(seq_len, cp, balance, doc)
    if doc is None:
        return KeyBlocks(Block(p) for p in pos)
    return KeyBlocks(Block(p, sequence.take(doc, p, 1)) for p in pos)


def _tokens(travel, keys: Block, rows: int) -> list[set[int]]:
    """Each row's travelling local indices of `keys` (pads, whose document is none of the
    keys', left out)."""
    if travel is None:
        return [set() for _ in range(rows)]
    if travel.index.dim() == 1:
        return [set(travel.index.tolist())] * rows
    real = torch.isin(travel.block.doc, keys.doc)
    return [set(travel.index[b][real[b]].tolist()) for b in range(rows)]


CASES = [(64, 4, "zigzag", True), (64, 4, "documents", True), (96, 2, "documents", True),
         (64, 4, "zigzag", False), (128, 8, "documents", True)]


@pytest.mark.parametrize("seq_len,cp,balance,documents", CASES)
def test_the_halo_from_segments_is_the_token_by_token_halo(seq_len, cp, balance, documents):
    rng = np.random.default_rng(seq_len + cp)
    for trial in range(4):
        doc = _rows(rng, 2, seq_len) if documents else None
        blocks = _blocks(seq_len, cp, balance, doc)
        rows = 1 if doc is None else 2
        for window in (1, 3, 8, 40, 2 * seq_len):
            for me in range(cp):
                halo = halo_plan(blocks, me, window)
                for j in range(cp):
                    if j == me:
                        continue
                    for travels, keys, queries in ((halo.send, me, j), (halo.recv, j, me)):
                        kb, qb = blocks[keys], blocks[queries]
                        want = window_needed(kb.pos, kb.doc, qb.pos, qb.doc, window)
                        expect = [set(want[b].nonzero()[:, 0].tolist()) for b in range(rows)]
                        assert _tokens(travels.get(j), kb, rows) == expect, (
                            trial, window, me, j)


@pytest.mark.parametrize("seq_len,cp,balance,documents",
                         [c for c in CASES if c[3]])  # without documents everything travels
def test_travelling_tokens_from_segments_are_the_token_by_token_ones(seq_len, cp, balance,
                                                                      documents):
    rng = np.random.default_rng(seq_len * cp)
    for _ in range(4):
        doc = _rows(rng, 2, seq_len)
        blocks = _blocks(seq_len, cp, balance, doc)
        for causal in (True, False):
            plan = travel_plan(blocks, causal)
            for j, kb in enumerate(blocks):
                for b in range(2):
                    pos, ids = kb.row_pos[b].tolist(), kb.doc[b].tolist()
                    others = [(d, p) for i, other in enumerate(blocks) if i != j
                              for d, p in zip(other.doc[b].tolist(), other.row_pos[b].tolist())]
                    want = {t for t, (d, p) in enumerate(zip(ids, pos))
                            if any(d == dq and (pq >= p or not causal) for dq, pq in others)}
                    assert _tokens(plan[j], kb, 2)[b] == want, (j, b, causal)
            assert plan[0].size == max(len(t) for p, kb in zip(plan, blocks)
                                       for t in _tokens(p, kb, 2))


def test_intervals_merge_into_their_union():
    lo, hi = merged(np.array([5, 0, 2, 9, 20, 20]), np.array([7, 3, 4, 12, 20, 21]))
    assert lo.tolist() == [0, 5, 9, 20] and hi.tolist() == [4, 7, 12, 21]
