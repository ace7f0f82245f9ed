"""The split of a global sequence across context-parallel ranks: the ONE definition.

The data path, the RoPE position ids, the loss labels, the attention masks and the tests all call
these functions, so a token's global position is never recomputed a second way.

- load_balance="none": S is cut into cp contiguous chunks; rank r holds chunk r.
- load_balance="zigzag": S is cut into 2*cp chunks; rank r holds chunks r and 2*cp-1-r, so every
  rank gets the same amount of causal attention work (docs/parallelism.md §3).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def rank_chunks(cp_rank: int, cp: int, load_balance: str) -> list[int]:
    """Chunk ids held by `cp_rank`, in the order they are laid out locally."""
    assert 0 <= cp_rank < cp, f"cp_rank {cp_rank} outside [0, {cp})"
    if load_balance == "zigzag":
        return [cp_rank, 2 * cp - 1 - cp_rank]
    assert load_balance == "none", f"unknown load_balance {load_balance!r}"
    return [cp_rank]


def num_chunks(cp: int, load_balance: str) -> int:
    return 2 * cp if load_balance == "zigzag" else cp


def check_divisible(seq_len: int, cp: int, load_balance: str) -> None:
    n = num_chunks(cp, load_balance)
    if seq_len % n:
        raise ValueError(f"sequence length {seq_len} is not divisible into {n} chunks "
                         f"(cp={cp}, load_balance={load_balance}); use a multiple of {n}")


def chunk_ranges(seq_len: int, cp_rank: int, cp: int, load_balance: str) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of a length-`seq_len` sequence that `cp_rank` holds, in local
    order. The data loader reads exactly these token ranges; `split` cuts tensors with them."""
    if cp == 1:
        return [(0, seq_len)]
    check_divisible(seq_len, cp, load_balance)
    width = seq_len // num_chunks(cp, load_balance)
    return [(c * width, (c + 1) * width) for c in rank_chunks(cp_rank, cp, load_balance)]


def split(x: Tensor, dim: int, cp_rank: int, cp: int, load_balance: str) -> Tensor:
    """This rank's part of the global tensor `x` along `dim` (a copy when chunks are not adjacent)."""
    if cp == 1:
        return x
    parts = [x.narrow(dim, a, b - a) for a, b in chunk_ranges(x.shape[dim], cp_rank, cp,
                                                               load_balance)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def merge(parts: list[Tensor], dim: int, load_balance: str) -> Tensor:
    """Inverse of `split`: the global tensor from every rank's part, given in cp-rank order."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    n = num_chunks(cp, load_balance)
    chunks: list[Tensor | None] = [None] * n
    for r, part in enumerate(parts):
        ids = rank_chunks(r, cp, load_balance)
        for c, piece in zip(ids, part.chunk(len(ids), dim=dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)


def positions(seq_len: int, cp_rank: int, cp: int, load_balance: str,
              device: torch.device | None = None) -> Tensor:
    """Global positions (0..S-1) of the tokens this rank holds, in local order. [S/cp]"""
    return split(torch.arange(seq_len, device=device), 0, cp_rank, cp, load_balance)


class Run(NamedTuple):
    """A maximal stretch of consecutive global positions inside one operand's tokens."""

    local: int
    """Index of its first token in the operand."""
    start: int
    """Global position of its first token."""
    length: int

    @property
    def end(self) -> int:
        """Global position just after its last token."""
        return self.start + self.length

    @property
    def rows(self) -> slice:
        """Its tokens' local indices."""
        return slice(self.local, self.local + self.length)

    def clamp(self, position: int) -> int:
        """`position` clamped into [start, end]."""
        return min(max(position, self.start), self.end)

    def part(self, offset: int, length: int) -> Run:
        """The sub-run of `length` tokens starting `offset` tokens in."""
        return Run(self.local + offset, self.start + offset, length)


def runs(pos: Tensor) -> list[Run]:
    """Maximal runs of consecutive positions in `pos` [S], in local order."""
    p = pos.tolist()
    out, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            out.append(Run(start, p[start], i - start))
            start = i
    return out


def document_positions(doc_ids: Tensor) -> Tensor:
    """Position of every token inside its own document [B, S] (RoPE restarts per document)."""
    s = doc_ids.shape[-1]
    idx = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    starts = torch.cummax(torch.where(new_doc, idx, 0), dim=-1).values
    return idx - starts
