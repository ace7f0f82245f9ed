"""What of a key block travels to other ranks: only the tokens some other rank's queries attend.

With packed documents a query sees only its own document's keys (causal: at or before its
position). A token of rank j's block is then needed elsewhere only if another rank holds a
query of the same document at or after it; a document held wholly by one rank is never sent.
Ring (and USP's ring) pass, and all-gather KV gathers, each block's *travelling* tokens only:
per batch row the needed tokens in local order, padded to n, the largest count of any block and
row (every rank computes the same n from the same blocks, so the buffers match). Pads carry a
document id no query has: no kernel call touches them. Without documents every token travels
and nothing here applies. Elements sent scale by n / (S/cp), the travelling share
(docs/parallelism.md §24).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from lctrain import device
from lctrain.attention.calls import Block, KeyBlocks
from lctrain.layout.segments import Segments, expand, prefixes
from lctrain.layout.sequence import take


@dataclass(frozen=True, eq=False)
class Travel:
    """The travelling tokens of one key block: local indices [B, n] (pads repeat index 0), or
    [n] when every row's are the same (no documents), and those tokens as a `Block`."""

    index: Tensor
    block: Block
    _on: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def size(self) -> int:
        """n: travelling tokens per row (padded)."""
        return self.index.shape[-1]

    def _index(self, device: torch.device) -> Tensor:
        if device not in self._on:
            self._on[device] = self.index.to(device, non_blocking=True)
        return self._on[device]

    def gather(self, x: Tensor) -> Tensor:
        """x [B, S, ...] -> its travelling tokens [B, n, ...] (contiguous, ready to send)."""
        return take(x, self._index(x.device), 1).contiguous()

    def add_into(self, acc: Tensor, grad: Tensor) -> None:
        """acc [B, S, ...] += grad [B, n, ...] at the travelling tokens (pads add zeros)."""
        index = self._index(acc.device)
        if index.dim() == 1:  # the same tokens in every row
            acc.index_add_(1, index, grad.to(acc.dtype))
            return
        view = [*index.shape] + [1] * (acc.dim() - 2)
        acc.scatter_add_(1, index.view(view).expand_as(grad), grad.to(acc.dtype))


@device.on_host
def travel_plan(blocks: KeyBlocks, causal: bool) -> list[Travel] | None:
    """For key blocks whose tokens are also the queries of their ranks (block i: rank i's
    tokens), each block's travelling tokens; None without documents (everything travels).
    Planned once per micro-batch (the blocks' `travel`)."""
    if causal not in blocks.travel:
        blocks.travel[causal] = None if blocks[0].doc is None else _plan(blocks, causal)
    return blocks.travel[causal]


def _plan(blocks: list[Block], causal: bool) -> list[Travel]:
    rows = blocks[0].doc.shape[0]
    stretches: list[list] = [[] for _ in blocks]  # [block][row]: (first local index, length)
    for b in range(rows):
        segs = [block.segments(b) for block in blocks]
        for j, elsewhere in enumerate(_latest_elsewhere(segs)):
            stretches[j].append(prefixes(segs[j], elsewhere, causal))
    n = max(int(length.sum()) for per_row in stretches for _, length in per_row)
    no_doc = min(int(block.doc.min()) for block in blocks) - 1  # a document no query has
    return [stretch_travel(block, per_row, no_doc, n)
            for block, per_row in zip(blocks, stretches)]


def _latest_elsewhere(segs: list[Segments]) -> list[np.ndarray]:
    """For each block's segments (one row), the latest position of each segment's document
    that another block holds (-1: none)."""
    docs, index = np.unique(np.concatenate([s.doc for s in segs]), return_inverse=True)
    at = np.cumsum([0, *(len(s.doc) for s in segs)])
    latest = np.full((len(segs), len(docs)), -1, dtype=np.int64)
    for j, s in enumerate(segs):
        np.maximum.at(latest[j], index[at[j]:at[j + 1]], s.end - 1)
    columns = np.arange(len(docs))
    top = latest.argmax(axis=0)  # the block holding the document's last token (positions are
    first = latest[top, columns]  # unique in a row: no ties but absent documents, -1 each)
    latest[top, columns] = -1
    second = latest.max(axis=0)
    of = [index[at[j]:at[j + 1]] for j in range(len(segs))]  # each segment's document
    return [np.where(top[d] == j, second[d], first[d]) for j, d in enumerate(of)]


def stretch_travel(block: Block, per_row: list[tuple[np.ndarray, np.ndarray]], no_doc: int,
                   n: int | None = None) -> Travel:
    """The block's tokens given per row as stretches (first local index, length), ascending,
    each inside one segment (consecutive positions of one document), as a Travel of n per row
    (default: the most any row has); pads get the document `no_doc`, which no query has, and
    positions past the block's that continue one run (the fewest runs to plan). Built stretch
    by stretch: the positions and documents come from each stretch's first token."""
    counts = [int(length.sum()) for _, length in per_row]
    n = max(counts) if n is None else n
    pos, doc = block.row_pos.numpy(), block.doc.numpy()
    index = np.zeros((len(per_row), n), dtype=np.int64)
    out_pos = np.empty(index.shape, dtype=pos.dtype)
    out_doc = np.empty(index.shape, dtype=doc.dtype)
    pad_from = int(pos.max()) + 1
    for b, ((first, length), k) in enumerate(zip(per_row, counts)):
        index[b, :k] = expand(first, length)
        out_pos[b, :k] = expand(pos[b, first], length)
        out_doc[b, :k] = np.repeat(doc[b, first], length)
        out_pos[b, k:] = np.arange(pad_from + k, pad_from + n)
        out_doc[b, k:] = no_doc
    return Travel(torch.from_numpy(index), Block(torch.from_numpy(out_pos),
                                                 torch.from_numpy(out_doc)))
