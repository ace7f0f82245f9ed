"""From packed samples to this rank's micro-batch: the cp chunks of tokens, labels, RoPE positions
and the document ids that document-masked attention needs.

Every source yields sample i as a `Window`: the `seq_len + 1` tokens of one training sequence,
made of document pieces whose lengths are known (a piece is a whole document or the part of one
that falls inside the window). Inputs are window[0:S], labels window[1:S+1]: labels are shifted on
the global sequence, before any split. A cp rank reads only its chunks (lctrain.layout.sequence,
the one split; with load_balance=documents each window's own, from its document lengths) plus one
token each for the shifted labels, so at 256K tokens and cp=16 a rank touches 1/16 of every
sequence. Document ids and positions come from the piece lengths, never from looking for EOS
tokens, so a document that crosses a window border or contains EOS is still right.
Windows may end in padding (only the last sample of an epoch does): padded labels are ignored and
padded tokens form one more document of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lctrain import device as accelerator
from lctrain.config.load_balances import split_of
from lctrain.layout import sequence

IGNORE_INDEX = -100
PAD = 0


@dataclass
class Window:
    """One training sequence of S + 1 tokens, as document pieces."""

    lengths: np.ndarray
    """int64 [pieces]: tokens of each document piece in order; their sum is at most S + 1 (the
    rest, if any, is padding)."""
    read: Callable[[int, int], np.ndarray]
    """read(lo, hi) -> the window's tokens [lo, hi) as integers; padding reads as PAD."""

    @property
    def valid(self) -> int:
        return int(self.lengths.sum())


def array_window(tokens: np.ndarray, lengths: np.ndarray, size: int) -> Window:
    """A window over tokens already in memory (generated sources, tests), padded to `size`."""
    assert len(tokens) == int(lengths.sum()) <= size, "pieces must cover the tokens given"

    def read(lo: int, hi: int) -> np.ndarray:
        out = np.full(hi - lo, PAD, dtype=np.int64)
        got = tokens[lo:min(hi, len(tokens))]
        out[:len(got)] = got
        return out

    return Window(np.asarray(lengths, dtype=np.int64), read)


@dataclass
class MicroBatch:
    """This rank's part of a micro-batch of B sequences (S/cp tokens each)."""

    inputs: Tensor
    """Token ids [B, S/cp] (int64), this cp rank's chunks of each sequence."""
    labels: Tensor
    """Next-token targets [B, S/cp], IGNORE_INDEX where there is none (padding)."""
    positions: Tensor
    """RoPE position ids: [1, S/cp] global positions, or [B, S/cp] positions inside each
    document (data.document_masking)."""
    doc_ids: Tensor | None
    """Document id of every token of the global sequences [B, S] (None: no document masking),
    always on the host."""
    global_positions: Tensor
    """Position of each local token in its global sequence: [1, S/cp], or [B, S/cp] when
    every row has its own split (load_balance=documents); on the host."""
    targets: int = -1
    """The valid next-token targets (labels other than IGNORE_INDEX), counted on the host
    where the labels are made: the step's token count reads nothing back from the device."""

    def __post_init__(self):
        if self.targets < 0:
            assert self.labels.device.type == "cpu", "count the targets before the move"
            self.targets = int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device) -> MicroBatch:
        """On `device` (a CUDA copy from pinned memory, asynchronous); the document ids stay on
        the host, where the attention kernels plan their calls from them."""
        def move(t: Tensor) -> Tensor:
            if not accelerator.pins(device):
                return t.to(device)
            return t.pin_memory().to(device, non_blocking=True)

        return MicroBatch(move(self.inputs), move(self.labels), move(self.positions),
                          self.doc_ids, self.global_positions, self.targets)


def document_ids(lengths: np.ndarray, size: int) -> np.ndarray:
    """Document id of each of the first `size` window positions; padding is one more document."""
    ids = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)[:size]
    return np.concatenate([ids, np.full(size - len(ids), len(lengths), dtype=np.int64)])


def build_micro_batch(windows: list[Window], seq_len: int, cp_rank: int, cp: int,
                      load_balance: str, document_masking: bool, ulysses: int = 1) -> MicroBatch:
    """This cp rank's MicroBatch of `windows`, reading only its chunks of each (`ulysses`: the
    cp ranks that share one balance unit, for load_balance=documents)."""
    per_row = split_of(load_balance).per_row and cp > 1
    assert document_masking or not per_row, f"load_balance={load_balance} needs document masking"
    inputs, labels, positions, docs, where = [], [], [], [], []
    for w in windows:
        ids = torch.from_numpy(document_ids(w.lengths, seq_len)) if document_masking else None
        lengths = sequence.document_lengths(ids) if per_row else None
        ranges = sequence.chunk_ranges(seq_len, cp_rank, cp, load_balance, lengths, ulysses)
        local_pos = torch.cat([torch.arange(a, b) for a, b in ranges])
        parts = [w.read(a, b + 1) for a, b in ranges]  # one more token for the shifted labels
        inputs.append(np.concatenate([p[:-1] for p in parts]))
        label = np.concatenate([p[1:] for p in parts])
        label[(local_pos + 1 >= w.valid).numpy()] = IGNORE_INDEX
        labels.append(label)
        where.append(local_pos)
        if document_masking:
            docs.append(ids)
            positions.append(sequence.document_positions(ids)[local_pos])
    as_tensor = (lambda xs: torch.from_numpy(np.stack(xs)).long())  # noqa: E731
    global_positions = torch.stack(where) if per_row else where[0][None]
    return MicroBatch(inputs=as_tensor(inputs), labels=as_tensor(labels),
                      positions=torch.stack(positions) if docs else global_positions,
                      doc_ids=torch.stack(docs) if docs else None,
                      global_positions=global_positions)


def micro_batch_from_tokens(tokens: Tensor, seq_len: int, cp_rank: int = 0, cp: int = 1,
                            load_balance: str = "zigzag", lengths: list[np.ndarray] | None = None,
                            document_masking: bool = False, ulysses: int = 1) -> MicroBatch:
    """MicroBatch of in-memory sequences [B, S + 1] (tests, tools), through the same path."""
    rows = tokens.numpy()
    windows = [array_window(r, np.array([len(r)]) if lengths is None else lengths[i], len(r))
               for i, r in enumerate(rows)]
    return build_micro_batch(windows, seq_len, cp_rank, cp, load_balance, document_masking,
                             ulysses)
