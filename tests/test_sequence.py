"""The one sequence split (its registered splits), document ids and positions, and the errors the
attention layer raises before any collective. No processes."""

import pytest
import torch

from lctrain.attention import ContextParallelAttention, CPGroups
from lctrain.config.keys import keys
from lctrain.config.load_balances import LOAD_BALANCES, LoadBalance, split_of
from lctrain.config.validation import validate
from lctrain.layout import sequence
from lctrain.layout.segments import segments
from tests.helpers import tiny_config


@pytest.mark.parametrize("cp,lb", [(1, "zigzag"), (2, "zigzag"), (3, "none"), (4, "zigzag"),
                                   (8, "none")])
def test_split_merge_round_trip(cp, lb):
    x = torch.arange(2 * 48).view(2, 48)
    parts = [sequence.split(x, 1, r, cp, lb) for r in range(cp)]
    assert torch.equal(sequence.merge(parts, 1, lb), x)
    assert sorted(torch.cat([sequence.positions(48, r, cp, lb) for r in range(cp)]).tolist()) \
        == list(range(48))
    for r in range(cp):  # positions and tokens come from the same split
        assert torch.equal(parts[r][0], sequence.positions(48, r, cp, lb))


def test_zigzag_chunks_and_segments():
    assert split_of("zigzag").rank_chunks(1, 4) == [1, 6]
    pos = sequence.positions(16, 1, 4, "zigzag")
    assert pos.tolist() == [2, 3, 12, 13]
    seg = segments(pos.numpy(), None)
    assert (seg.local.tolist(), seg.start.tolist(), seg.length.tolist()) == ([0, 2], [2, 12],
                                                                            [2, 2])
    with pytest.raises(ValueError, match="not divisible into 8 chunks"):
        sequence.split(torch.zeros(1, 20), 1, 0, 4, "zigzag")


def test_document_positions_restart_per_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3]])
    assert sequence.document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2],
                                                         [0, 0, 1, 2, 3, 4, 0, 0]]


def test_chunk_ranges():
    assert sequence.chunk_ranges(16, 1, 4, "zigzag") == [(2, 4), (12, 14)]
    assert sequence.chunk_ranges(48, 2, 3, "none") == [(32, 48)]
    assert sequence.chunk_ranges(10, 0, 1, "zigzag") == [(0, 10)]


def test_attention_rejects_bad_shapes_before_any_collective():
    groups = CPGroups(cp=None, ring=None, ulysses=None, ring_size=1, ulysses_size=4)
    attn = ContextParallelAttention("ulysses", groups, 64, "zigzag")
    q, k = torch.zeros(1, 16, 6, 8), torch.zeros(1, 16, 2, 8)
    with pytest.raises(ValueError, match=r"Ulysses degree 4 needs the query heads \(6\)"):
        attn(q, k, k)
    with pytest.raises(ValueError, match="expects local sequence 16"):
        attn(torch.zeros(1, 12, 8, 8), k, k)
    with pytest.raises(ValueError, match="doc_ids must cover the global sequence"):
        attn(torch.zeros(1, 16, 8, 8), torch.zeros(1, 16, 4, 8), torch.zeros(1, 16, 4, 8),
             torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible into 8 chunks"):
        ContextParallelAttention("ring", CPGroups(None, None, None, ring_size=4), 36, "zigzag")
    with pytest.raises(ValueError, match="unknown attention algorithm"):
        ContextParallelAttention("flash", groups, 64, "zigzag")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_block_kernels_with_offsets_documents_and_empty_rows(dtype, tol):
    """Queries at 4..11 against keys at 0..5 and 10..13 with documents: offset diagonals,
    general masks and rows that see no key at all (lse -inf, output 0, zero gradients)."""
    from lctrain.attention.calls import Block
    from lctrain.attention.local import local_attention
    from tests.reference import reference_attention

    gen = torch.Generator().manual_seed(0)
    doc = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0] * 7 + [1] * 7])
    qb = Block(torch.arange(4, 12), doc[:, 4:12])
    kpos = torch.cat([torch.arange(0, 6), torch.arange(10, 14)])
    kb = Block(kpos, doc[:, kpos])
    q = torch.randn(2, 8, 4, 6, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, 10, 2, 6, generator=gen, dtype=dtype) for _ in range(2))
    dout = torch.randn(2, 8, 4, 6, generator=gen, dtype=dtype)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = local_attention(*ours, qb, kb, causal=True, scale=0.4)
    ref_out, ref_lse = reference_attention(*ref, qb, kb, True, 0.4)
    out.backward(dout)
    ref_out.backward(dout.double())
    empty = ~torch.isfinite(ref_lse)
    assert empty.any() and torch.equal(~torch.isfinite(lse), empty)  # some rows see nothing
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    for a, b in zip(ours, ref):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=tol, atol=tol)


def test_a_registered_split_is_valid_everywhere_and_only_while_registered():
    """A split is one registry entry (config/load_balances.py): registered, it is an allowed
    value, validation takes it, `lctrain keys` lists it, and the split, its inverse and the
    positions follow its chunks; removed, it is refused again."""
    toy = LoadBalance("reversed", "rank r holds chunk cp - 1 - r (a toy)",
                      lambda r, cp: [cp - 1 - r])
    cfg = tiny_config(parallel={"cp": 2, "load_balance": "reversed"})
    with LOAD_BALANCES.registered(toy):
        assert validate(cfg, 2) == []
        assert "reversed" in next(k for k in keys("parallel")
                                  if k.name == "parallel.load_balance").allowed
        x = torch.arange(16).view(1, 16)
        parts = [sequence.split(x, 1, r, 2, "reversed") for r in range(2)]
        assert parts[0].tolist() == [list(range(8, 16))]
        assert torch.equal(sequence.merge(parts, 1, "reversed"), x)
        assert torch.equal(sequence.positions(16, 0, 2, "reversed"), parts[0][0])
    assert any("parallel.load_balance" in problem for problem in validate(cfg, 2))
