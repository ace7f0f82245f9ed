"""The balanced split of packed documents (load_balance=documents), without processes.

References: token counts and positions from the lengths themselves, causal work counted from
the kernels' own call decomposition (`kernel_calls`), the travelling tokens counted by the
attention's plan (`travel_plan`) against the layout's count, and the bound of
docs/parallelism.md §24 on random corpora.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lctrain.attention.calls import Block, KeyBlocks, kernel_calls, pairs_computed
from lctrain.attention.travel import travel_plan
from lctrain.layout import sequence
from lctrain.layout.packed import (
    LENGTH_MIXES,
    causal_work,
    sample_rows,
    split_cost,
    travelling_tokens,
)


def doc_work(length: int) -> int:
    return length * (length + 1) // 2


@st.composite
def corpora(draw):
    """(lengths, cp): a row of S = k cp >= 2 cp^2 tokens cut into random documents."""
    cp = draw(st.sampled_from([2, 4, 8, 16]))
    seq_len = cp * draw(st.integers(2 * cp, 40 * cp))
    cuts = draw(st.lists(st.integers(1, seq_len - 1), max_size=60, unique=True))
    bounds = [0, *sorted(cuts), seq_len]
    return np.diff(bounds).astype(np.int64), cp


@settings(max_examples=300, deadline=None)
@given(corpora())
def test_split_is_exact_and_within_its_bound(case):
    lengths, cp = case
    seq_len, per = int(lengths.sum()), int(lengths.sum()) // cp
    units = sequence.document_ranges(lengths, cp)
    tokens = np.concatenate([np.arange(a, b) for r in units for a, b in r])
    assert np.array_equal(np.sort(tokens), np.arange(seq_len))  # every token, once
    for ranges in units:
        assert sum(b - a for a, b in ranges) == per  # exactly S/cp
        assert all(a < b for a, b in ranges) and list(ranges) == sorted(ranges)
    assert units == sequence.document_ranges(lengths.copy(), cp)  # deterministic
    work = np.array([causal_work(lengths, r) for r in units], dtype=np.float64)
    # §24: no unit exceeds the mean by one document's triangle of at most S/cp tokens
    assert work.max() - work.mean() <= doc_work(min(int(lengths.max()), per))


def test_one_document_is_zigzag_and_groups_share_their_unit():
    for cp in (2, 4, 8):
        lengths = np.array([16 * cp])
        for r in range(cp):
            got = sequence.chunk_ranges(16 * cp, r, cp, "documents", lengths)
            want = sequence.chunk_ranges(16 * cp, r, cp, "zigzag")
            assert sequence.positions(16 * cp, r, cp, "zigzag").tolist() == [
                t for a, b in got for t in range(a, b)], (cp, r, got, want)
    # USP: a unit of u ranks is balanced as one; its members hold consecutive shares of it
    lengths = np.array([3, 40, 1, 7, 29, 48])
    seq_len, cp, u = int(lengths.sum()), 4, 2
    for g, unit in enumerate(sequence.document_ranges(lengths, cp // u)):
        tokens = [t for a, b in unit for t in range(a, b)]
        members = [[t for a, b in sequence.chunk_ranges(seq_len, g * u + m, cp, "documents",
                                                        lengths, u) for t in range(a, b)]
                   for m in range(u)]
        assert members[0] + members[1] == tokens


@pytest.mark.parametrize("mix", sorted(LENGTH_MIXES))
def test_realistic_mixes_balance_within_two_percent_where_zigzag_does_not(mix):
    rows = sample_rows(LENGTH_MIXES[mix], 131072, 4, seed=1)
    for cp in (4, 8, 16):
        zigzag = [split_cost(r, cp, "zigzag").max_over_mean for r in rows]
        documents = [split_cost(r, cp, "documents").max_over_mean for r in rows]
        assert max(documents) <= 1.02, (mix, cp, documents)
        assert np.mean(zigzag) > 1.05, (mix, cp, zigzag)


def _kernel_work(qb: Block, keys: list[Block]) -> int:
    """Causal pairs the kernels compute for qb's queries."""
    return sum(pairs_computed(kernel_calls(qb, kb, causal=True)) for kb in keys)


def test_work_and_travelling_tokens_match_the_attention_plans():
    """The layout's counts (the planner's) equal what the attention runs and sends."""
    rng = np.random.default_rng(0)
    for lb, cp in (("documents", 4), ("zigzag", 4), ("documents", 2)):
        rows = [np.diff([0, *sorted(rng.choice(np.arange(1, 96), 6, replace=False)), 96])
                for _ in range(2)]
        docs = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.from_numpy(r))
                            for r in rows])
        pos = [sequence.positions(96, r, cp, lb, doc_ids=docs).expand(2, -1) for r in range(cp)]
        blocks = KeyBlocks(Block(p, docs.gather(1, p)) for p in pos)
        plan = travel_plan(blocks, causal=True)
        for b, lengths in enumerate(rows):
            ranges = [sequence.chunk_ranges(96, r, cp, lb, lengths) for r in range(cp)]
            row_blocks = [Block(p[b:b + 1], docs[b:b + 1].gather(1, p[b:b + 1])) for p in pos]
            for r in range(cp):
                assert _kernel_work(row_blocks[r], row_blocks) == causal_work(lengths, ranges[r])
            row_plan = travel_plan(KeyBlocks(row_blocks), causal=True)
            assert row_plan[0].size == travelling_tokens(lengths, ranges)
        assert plan[0].size == max(travelling_tokens(r, [sequence.chunk_ranges(
            96, k, cp, lb, r) for k in range(cp)]) for r in rows)


def test_documents_held_by_one_rank_never_travel():
    lengths = np.array([14] * 8)  # each unit takes two whole documents
    units = sequence.document_ranges(lengths, 4)
    for ranges in units:
        assert all(a % 14 == 0 and b % 14 == 0 for a, b in ranges), units
    assert travelling_tokens(lengths, [list(r) for r in units]) == 0
    assert split_cost(lengths, 4, "documents").share == 0
