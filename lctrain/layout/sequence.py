"""The split of a global sequence across context-parallel ranks: the ONE definition.

The data path, the RoPE position ids, the loss labels, the attention masks, the evals and the
tests all call these functions, so a token's global position is never recomputed a second way.

The splits are the entries of `lctrain.config.load_balances`: a fixed split cuts S into equal
chunks and gives each rank its entry's chunk ids (none: rank r holds chunk r of cp; zigzag: chunks
r and 2*cp-1-r of 2*cp, so every rank gets the same causal work for one document,
docs/parallelism.md §3); a per-row split (documents) cuts each packed row by its own document
lengths alone (`document_ranges`, docs/parallelism.md §24): exactly S/cp tokens per rank and the
causal work of the row's documents balanced, short documents kept whole where that balances. It
needs the document ids; its positions are [B, S/cp], one row per sequence.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from lctrain.config.load_balances import split_of


def check_divisible(seq_len: int, cp: int, balance: str) -> None:
    n = split_of(balance).chunks(cp)
    if seq_len % n:
        raise ValueError(f"sequence length {seq_len} is not divisible into {n} chunks "
                         f"(cp={cp}, load_balance={balance}); use a multiple of {n}")


Ranges = tuple[tuple[int, int], ...]
"""[start, stop) stretches of a row, ascending."""


def document_lengths(doc_ids: Tensor | np.ndarray) -> np.ndarray:
    """Lengths of the maximal stretches of equal ids in one row [S] (its documents, in order)."""
    ids = np.asarray(doc_ids)
    cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    return np.diff(np.concatenate([[0], cuts, [len(ids)]])).astype(np.int64)


def causal_pairs(lo: np.ndarray | int, hi: np.ndarray | int):
    """Causal (query, key) pairs of a document's tokens [lo, hi): token i sees i + 1 keys."""
    return (hi * (hi + 1) - lo * (lo + 1)) // 2


def _merged(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def document_ranges(lengths: np.ndarray, units: int) -> tuple[Ranges, ...]:
    """The balanced split of one packed row (documents of `lengths`, in order) into `units`
    parts of exactly S/units tokens each, S = sum(lengths); docs/parallelism.md §24.

    Work is counted in causal pairs (a document's token i attends i + 1 keys). A document
    longer than S/units, but the longest, is cut zigzag into 2 units pieces (unit u: pieces u
    and 2 units - 1 - u, equal work per unit; `_piece_sizes`). The other documents, shortest
    first, then the longest, form one "region"; unit u, in order, takes x tokens from the
    region's front and the rest of its S/units from the region's back, x chosen so that the
    work of units 0..u together comes closest to u + 1 times the mean (front tokens are early
    in short documents, cheap; back tokens are the end of the longest, expensive; an error is
    made up by the next unit instead of piling up on the last). The region is cut at most
    twice per unit, so at most 2 units - 1 of its documents cross units; the rest stay whole.
    Deterministic: every rank computes the same split from the same lengths.
    """
    return _document_ranges(np.asarray(lengths, dtype=np.int64).tobytes(), units)


@lru_cache(maxsize=512)  # every rank and layer asks for the same rows within a micro-batch
def _document_ranges(lengths_bytes: bytes, units: int) -> tuple[Ranges, ...]:
    lengths = np.frombuffer(lengths_bytes, dtype=np.int64)
    seq_len = int(lengths.sum())
    assert seq_len % units == 0, f"{seq_len} tokens do not split into {units} equal parts"
    per, starts = seq_len // units, np.cumsum(lengths) - lengths
    target = float(causal_pairs(0, lengths).sum()) / units
    taken: list[list[tuple[int, int]]] = [[] for _ in range(units)]
    tokens, work = np.zeros(units, dtype=np.int64), np.zeros(units)
    by_length = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    long_docs = [i for i in by_length if lengths[i] > per]
    for i in long_docs[1:]:  # zigzag inside the document: 2 units near-equal pieces
        size = _piece_sizes(int(lengths[i]), tokens)
        cut = np.concatenate([[0], np.cumsum(size)])
        for piece in range(2 * units):
            u = piece if piece < units else 2 * units - 1 - piece
            lo, hi = int(cut[piece]), int(cut[piece + 1])
            taken[u].append((int(starts[i]) + lo, int(starts[i]) + hi))
            tokens[u] += hi - lo
            work[u] += causal_pairs(lo, hi)
    region = sorted([i for i in by_length if lengths[i] <= per] + long_docs[:1],
                    key=lambda i: (lengths[i], i))
    seg_len = lengths[region]
    seg_at = np.cumsum(seg_len) - seg_len  # each document's offset in the region
    # region offset -> causal pairs before it (prefix sums of 1..L per document)
    weight = np.arange(int(seg_len.sum()), dtype=np.int64) + 1 - np.repeat(seg_at, seg_len)
    prefix = np.concatenate([[0], np.cumsum(weight)])
    lo, hi, behind = 0, len(weight), 0.0  # behind: work the units so far lack of the mean
    for u in range(units):
        n = per - int(tokens[u])
        assert n >= 0, f"{seq_len} tokens over {units} units: below 2 units^2 (validation)"
        if u == units - 1:
            x = hi - lo
        else:  # the x whose work brings the units so far closest to their mean, all together
            # taking x from the front and n - x from the back, x = 0..n (slices: no copies)
            got = prefix[lo:lo + n + 1] - prefix[lo] + prefix[hi] - prefix[hi - n:hi + 1]
            x = int(np.argmin(np.abs(got + work[u] - target - behind)))
            behind += target - (float(got[x]) + work[u])
        for a, b in ((lo, lo + x), (hi - (n - x), hi)):
            taken[u] += _region_ranges(a, b, seg_at, seg_len, starts[region])
        lo, hi = lo + x, hi - (n - x)
    assert lo == hi, "the region's tokens are all taken"
    return tuple(_merged(t) for t in taken)


def forget_splits() -> None:
    """Drop the documents splits cached so far (a benchmark that times planning afresh)."""
    _document_ranges.cache_clear()


def _piece_sizes(length: int, tokens: np.ndarray) -> np.ndarray:
    """Sizes of a document's 2 units zigzag pieces (piece j belongs to unit j, or 2 units - 1 - j
    past the middle): length // (2 units) each, and the remainder one token at a time to the
    units that hold the fewest tokens so far, front piece first, so no unit's count drifts
    more than 2 above another's over many documents."""
    units = len(tokens)
    size = np.full(2 * units, length // (2 * units), dtype=np.int64)
    order = np.argsort(tokens, kind="stable")
    for k in range(length % (2 * units)):
        u = int(order[k % units])
        size[u if k < units else 2 * units - 1 - u] += 1
    return size


def _region_ranges(a: int, b: int, seg_at: np.ndarray, seg_len: np.ndarray,
                   seg_start: np.ndarray) -> list[tuple[int, int]]:
    """Region offsets [a, b) as global ranges (one per document they touch)."""
    out = []
    first = int(np.searchsorted(seg_at, a, side="right")) - 1
    for j in range(max(first, 0), len(seg_at)):
        if seg_at[j] >= b:
            break
        lo, hi = max(a, int(seg_at[j])), min(b, int(seg_at[j] + seg_len[j]))
        if hi > lo:
            out.append((int(seg_start[j]) + lo - int(seg_at[j]),
                        int(seg_start[j]) + hi - int(seg_at[j])))
    return out


def _take_tokens(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """The tokens [lo, hi) of the token list that `ranges` spell, as ranges."""
    out, seen = [], 0
    for a, b in ranges:
        s, e = max(lo, seen), min(hi, seen + b - a)
        if e > s:
            out.append((a + s - seen, a + e - seen))
        seen += b - a
    return tuple(out)


def chunk_ranges(seq_len: int, cp_rank: int, cp: int, load_balance: str,
                 lengths: np.ndarray | None = None, ulysses: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of each stretch of a length-`seq_len` sequence that `cp_rank` holds, in
    local order. The data loader reads exactly these token ranges; `split` cuts tensors with
    them. documents: `lengths` are the row's documents; the balance unit is a group of
    `ulysses` consecutive cp ranks (USP's Ulysses group, whose ranks pool their tokens before
    attending; Ulysses alone is one group of cp), each of which holds a contiguous share of its
    group's tokens."""
    if cp == 1:
        return [(0, seq_len)]
    check_divisible(seq_len, cp, load_balance)
    split = split_of(load_balance)
    if split.per_row:
        assert lengths is not None, f"load_balance={load_balance} needs the document lengths"
        assert int(np.sum(lengths)) == seq_len and cp % ulysses == 0, (seq_len, cp, ulysses)
        unit = document_ranges(lengths, cp // ulysses)[cp_rank // ulysses]
        local, member = seq_len // cp, cp_rank % ulysses
        return list(_take_tokens(unit, member * local, (member + 1) * local))
    width = seq_len // split.chunks(cp)
    return [(c * width, (c + 1) * width) for c in split.rank_chunks(cp_rank, cp)]


def _range_positions(ranges: list[tuple[int, int]]) -> Tensor:
    """The positions of [start, stop) ranges, concatenated: one vectorised expression however
    many ranges (a documents split cuts a row into one per document it touches)."""
    bounds = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    lengths = bounds[:, 1] - bounds[:, 0]
    shift = bounds[:, 0] - (np.cumsum(lengths) - lengths)  # start - offset in the output
    return torch.from_numpy(np.arange(int(lengths.sum())) + np.repeat(shift, lengths))


def _row_positions(seq_len: int, cp_rank: int, cp: int, load_balance: str,
                   doc_ids: Tensor | None, ulysses: int,
                   lengths: list[np.ndarray] | None = None) -> Tensor:
    """[S/cp] (zigzag, none) or [B, S/cp] (documents) global positions, on the host.
    `lengths`: each row's document lengths, when the caller has them."""
    def of(row_lengths: np.ndarray | None) -> Tensor:
        return _range_positions(chunk_ranges(seq_len, cp_rank, cp, load_balance, row_lengths,
                                             ulysses))

    if not split_of(load_balance).per_row or cp == 1:
        return of(None)
    assert doc_ids is not None, "load_balance=documents needs the document ids"
    if lengths is None:
        lengths = [document_lengths(row) for row in doc_ids.cpu().numpy()]
    return torch.stack([of(row) for row in lengths])


def every_rank_positions(seq_len: int, cp: int, load_balance: str,
                         doc_ids: Tensor | None = None, ulysses: int = 1) -> list[Tensor]:
    """`positions` of every cp rank, in cp-rank order (each row's documents read once)."""
    lengths = None if doc_ids is None or not split_of(load_balance).per_row or cp == 1 else [
        document_lengths(row) for row in doc_ids.cpu().numpy()]
    return [_row_positions(seq_len, r, cp, load_balance, doc_ids, ulysses, lengths)
            for r in range(cp)]


def take(x: Tensor, index: Tensor, dim: int) -> Tensor:
    """x's entries at `index` along `dim` (not 0): index [n], the same for every row, or
    [B, n], one per batch row (dim 0 of x)."""
    index = index.to(x.device)
    if index.dim() == 1:
        return x.index_select(dim, index)
    view, size = [index.shape[0]] + [1] * (x.dim() - 1), list(x.shape)
    view[dim] = size[dim] = index.shape[1]
    return x.gather(dim, index.view(view).expand(size))


def split(x: Tensor, dim: int, cp_rank: int, cp: int, load_balance: str,
          doc_ids: Tensor | None = None, ulysses: int = 1) -> Tensor:
    """This rank's part of the global tensor `x` along `dim` (batch rows on dim 0; documents:
    doc_ids [B, S] name each row's documents)."""
    if cp == 1:
        return x
    if split_of(load_balance).per_row:
        return take(x, positions(x.shape[dim], cp_rank, cp, load_balance, doc_ids=doc_ids,
                                 ulysses=ulysses), dim)
    parts = [x.narrow(dim, a, b - a) for a, b in chunk_ranges(x.shape[dim], cp_rank, cp,
                                                               load_balance)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def merge(parts: list[Tensor], dim: int, load_balance: str, doc_ids: Tensor | None = None,
          ulysses: int = 1) -> Tensor:
    """Inverse of `split`: the global tensor from every rank's part, given in cp-rank order."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    seq_len = sum(p.shape[dim] for p in parts)
    split = split_of(load_balance)
    if split.per_row:
        index = torch.cat([positions(seq_len, r, cp, load_balance, doc_ids=doc_ids,
                                     ulysses=ulysses) for r in range(cp)], dim=-1)
        return take(torch.cat(parts, dim=dim), torch.argsort(index, dim=-1), dim)
    chunks: list[Tensor | None] = [None] * split.chunks(cp)
    for r, part in enumerate(parts):
        ids = split.rank_chunks(r, cp)
        for c, piece in zip(ids, part.chunk(len(ids), dim=dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)


def positions(seq_len: int, cp_rank: int, cp: int, load_balance: str,
              device: torch.device | None = None, doc_ids: Tensor | None = None,
              ulysses: int = 1) -> Tensor:
    """Global positions (0..S-1) of the tokens this rank holds, in local order: [S/cp], or
    [B, S/cp] for load_balance=documents (each row of doc_ids [B, S] has its own split)."""
    pos = _row_positions(seq_len, cp_rank, cp, load_balance, doc_ids, ulysses)
    return pos if device is None else pos.to(device)


def document_positions(doc_ids: Tensor) -> Tensor:
    """Position of every token inside its own document [B, S] (RoPE restarts per document)."""
    s = doc_ids.shape[-1]
    idx = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    starts = torch.cummax(torch.where(new_doc, idx, 0), dim=-1).values
    return idx - starts
