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

import torch
from torch import Tensor

from lctrain import device
from lctrain.attention.calls import Block
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
def travel_plan(blocks: list[Block], causal: bool) -> list[Travel] | None:
    """For key blocks whose tokens are also the queries of their ranks (block i: rank i's
    tokens), each block's travelling tokens; None without documents (everything travels).
    Planned once per list of blocks (cached on the first)."""
    if blocks[0].doc is None:
        return None
    key = ("travel", tuple(id(b) for b in blocks), causal)
    cached = blocks[0]._plans.get(key)
    if cached is None or any(a is not b for a, b in zip(cached[0], blocks)):
        cached = (list(blocks), _plan(blocks, causal))
        blocks[0]._plans[key] = cached
    return cached[1]


def _plan(blocks: list[Block], causal: bool) -> list[Travel]:
    docs = [b.doc for b in blocks]
    pos = [b.row_pos for b in blocks]
    ids, n_docs = _dense_ids(torch.cat(docs, dim=1))
    ids = ids.split([d.shape[1] for d in docs], dim=1)
    rows = docs[0].shape[0]
    # latest position of each document in each block (-1: absent)
    latest = torch.stack([torch.full((rows, n_docs), -1, dtype=torch.long).scatter_reduce(
        1, i, p, "amax") for i, p in zip(ids, pos)])
    needed = []
    for j in range(len(blocks)):
        others = torch.cat([latest[:j], latest[j + 1:]]).amax(0)  # [B, D]
        seen = others.gather(1, ids[j])  # the latest query of each token's document elsewhere
        needed.append(seen >= pos[j] if causal else seen >= 0)
    n = max(int(m.sum(1).max()) for m in needed)
    no_doc = min(int(d.min()) for d in docs) - 1  # a document no query has
    return [padded_travel(b, m, no_doc, n) for b, m in zip(blocks, needed)]


def _dense_ids(doc: Tensor) -> tuple[Tensor, int]:
    """Document ids as indices 0..D-1 of a table of D entries (a document's entry may be
    unused): offset by the smallest when the ids span at most a few times the tokens, as the
    loader's consecutive ids do (no sort), else ranked by `torch.unique`."""
    low, high = int(doc.min()), int(doc.max())
    if high - low < 4 * doc.numel():
        return doc - low, high - low + 1
    _, inverse = torch.unique(doc, return_inverse=True)
    return inverse, int(inverse.max()) + 1


def padded_travel(block: Block, needed: Tensor, no_doc: int, n: int | None = None) -> Travel:
    """The block's needed tokens [B, S] (bool) as a Travel of n per row (default: the most any
    row needs); pads get the document `no_doc`, which no query has."""
    rows, pos = needed.shape[0], block.row_pos
    n = int(needed.sum(1).max()) if n is None else n
    index = torch.zeros(rows, n, dtype=torch.long)
    real = torch.zeros(rows, n, dtype=torch.bool)
    for b in range(rows):
        got = needed[b].nonzero()[:, 0]
        index[b, :len(got)], real[b, :len(got)] = got, True
    # pads: positions that continue one run (fewest runs to plan)
    doc = torch.where(real, take(block.doc, index, 1), no_doc)
    after = int(pos.max()) + 1 + torch.arange(n).expand(rows, n)
    return Travel(index, Block(torch.where(real, take(pos, index, 1), after), doc))
