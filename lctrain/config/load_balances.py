"""The splits of a global sequence across context-parallel ranks (`parallel.load_balance`), as
every layer sees them: one registry entry per split, holding its name, the fixed chunks each
rank takes (the arithmetic of the split itself) or that each packed row is split by its own
documents, and the facts the attention, the data path, validation and the planner ask of it.
Nobody compares a split's name: they ask its entry (`split_of(name)`). `auto` is not a
split: it picks one (`auto_load_balance`).

The per-row split's algorithm (`document_ranges`) is the code of `lctrain.layout.sequence`, the
one definition of where each token goes; docs/parallelism.md §3 (zigzag) and §24 (documents)
derive them. This module imports nothing from lctrain but the registry: it sits in the config
layer, so that the schema reads its names (`one_of("auto", registry=LOAD_BALANCES)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lctrain.config.registry import Registry


@dataclass(frozen=True)
class LoadBalance:
    name: str
    """The value of parallel.load_balance that selects it."""
    summary: str
    """One line for `lctrain keys` and the docs."""
    chunk_ids: Callable[[int, int], list[int]] | None
    """chunk_ids(cp_rank, cp): the ids of the equal chunks of S that the rank holds, in local
    order, S cut into `chunks_per_rank` x cp chunks; None: no fixed chunks, each packed row is
    split by its own document lengths (`per_row`)."""
    chunks_per_rank: int = 1
    """Chunks of a fixed split each rank holds (a per-row split: S/cp tokens per rank, as one)."""
    group_in_order: bool = True
    """Whether the tokens of consecutive cp ranks, gathered in rank order (a Ulysses group), are
    in position order: attention over them needs no sort (zigzag's are not)."""

    @property
    def per_row(self) -> bool:
        """Each packed row has its own split, from its documents: positions [B, S/cp], and the
        document ids are needed (data.document_masking)."""
        return self.chunk_ids is None

    def chunks(self, cp: int) -> int:
        """The equal parts S must divide into over cp ranks."""
        return self.chunks_per_rank * cp

    def rank_chunks(self, cp_rank: int, cp: int) -> list[int]:
        """Chunk ids held by `cp_rank`, in the order they are laid out locally."""
        assert self.chunk_ids is not None, f"load_balance={self.name} has no fixed chunks"
        assert 0 <= cp_rank < cp, f"cp_rank {cp_rank} outside [0, {cp})"
        return self.chunk_ids(cp_rank, cp)

    def min_seq_len(self, units: int) -> int:
        """The shortest sequence the split takes over `units` balance units: a per-row split
        needs 2 units^2 tokens (docs/parallelism.md §24); a fixed one, its chunks (checked on
        their own)."""
        return 2 * units * units if self.per_row else 0


LOAD_BALANCES: Registry[LoadBalance] = Registry("load balance")

LOAD_BALANCES.add(LoadBalance(
    "zigzag", "2 cp chunks, rank r holds chunks r and 2 cp - 1 - r: the causal work of one "
    "document per sequence balanced", lambda r, cp: [r, 2 * cp - 1 - r], chunks_per_rank=2,
    group_in_order=False))
LOAD_BALANCES.add(LoadBalance(
    "none", "cp contiguous chunks, rank r holds chunk r", lambda r, cp: [r]))
LOAD_BALANCES.add(LoadBalance(
    "documents", "each packed row split by its own documents: S/cp tokens per rank, causal work "
    "balanced, short documents kept whole; needs data.document_masking", None))


def split_of(name: str) -> LoadBalance:
    """The registered split `name` (KeyError naming the registered ones otherwise)."""
    return LOAD_BALANCES[name]


def auto_load_balance(document_masking: bool) -> str:
    """What `auto` picks: the split by documents when packed documents are masked (each row
    balanced by its own documents), zigzag otherwise (docs/parallelism.md §24)."""
    return "documents" if document_masking else "zigzag"
