"""Sequence tiling: the loss and the MLP computed over sequence chunks, each in its own
checkpoint, so that their widest tensors ([S/cp, V/tp] logits, [S/cp, ffn/tp] SwiGLU
intermediates) exist one chunk at a time (train.loss_chunk, train.mlp_chunk). The math is
unchanged: gradients equal the untiled ones.

Under TP the chunks are cut in the layout each module sees: the loss head gathers the
sequence-parallel hidden state once and cuts the replicated sequence; the MLP, whose output is
reduce-scattered along the sequence under SP, cuts each rank's sequence shard into pieces and
runs chunk j on piece j of every rank, so that the reduce-scatter hands each rank back its own
piece and the pieces line up into its shard again.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from lctrain.models.blocks import FeedForward
from lctrain.models.decoder import cross_entropy_sum
from lctrain.models.moe import MoE, sorted_counts
from lctrain.parallel.experts import ExpertParallel


class ChunkedLoss:
    """A loss head (`Decoder.loss_head`) over chunks of `chunk` tokens: each chunk's logits are
    computed, reduced to its loss sum, and dropped; the backward computes them again."""

    def __init__(self, chunk: int, chunk_loss=None):
        self.chunk = chunk
        self.chunk_loss = chunk_loss or _chunk_loss

    def __call__(self, output: nn.Module, h: Tensor, labels: Tensor) -> Tensor:
        if isinstance(h, DTensor) and not all(isinstance(p, Replicate) for p in h.placements):
            h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)  # one all-gather
        total = None
        for start in range(0, h.shape[1], self.chunk):
            piece = checkpoint(self.chunk_loss, output, h[:, start:start + self.chunk],
                               labels[:, start:start + self.chunk], use_reentrant=False)
            total = piece if total is None else total + piece
        return total


def _chunk_loss(output: nn.Module, h: Tensor, labels: Tensor) -> Tensor:
    return cross_entropy_sum(output(h), labels)


class _SequenceTiled(nn.Module):
    """An MLP (the class after this one in a subclass's bases) over sequence chunks of about
    `chunk` tokens, each in its own checkpoint (installed on an existing module by
    `apply_mlp_tiling`; parameters unchanged)."""

    chunk: int
    shard_groups: int
    """TP ranks whose sequence shards are interleaved into each chunk (1 without SP)."""

    def forward(self, x: Tensor) -> Tensor:
        mlp = super().forward  # (not inside the comprehension: its own scope)
        return torch.cat([checkpoint(mlp, self._cut(x, index), use_reentrant=False)
                          for index in self._pieces(x)], dim=1)

    def _pieces(self, x: Tensor) -> list[Tensor]:
        """The local sequence indices of each chunk."""
        n = max(1, -(-x.shape[1] // self.chunk))
        if self.shard_groups == 1:
            return list(torch.tensor_split(torch.arange(x.shape[1], device=x.device), n))
        # SP: chunk j takes piece j of each rank's shard; the reduce-scatter after w2 hands this
        # rank its piece j (a local tensor), and its pieces in order are its shard
        t, shard = self.shard_groups, x.shape[1] // self.shard_groups
        pieces = torch.tensor_split(torch.arange(shard, device=x.device), n)
        return [torch.cat([r * shard + p for r in range(t)]) for p in pieces]

    @staticmethod
    def _cut(x: Tensor, index: Tensor) -> Tensor:
        if isinstance(x, DTensor):  # replicated over tp: cut the local copy
            return DTensor.from_local(x.to_local().index_select(1, index), x.device_mesh,
                                      x.placements, run_check=False)
        return x.index_select(1, index)


class TiledFeedForward(_SequenceTiled, FeedForward):
    """The dense gated MLP, tiled."""


class TiledMoE(_SequenceTiled, MoE):
    """A mixture of experts, tiled: each chunk routes its own tokens; the routing statistics
    add up over the chunks (and are recorded once, not again when a chunk is recomputed).

    Under expert parallelism every chunk's experts are chosen first (without gradient), and
    one exchange of all chunks' counts, read on the host once, gives each chunk its all-to-all
    sizes: the layer waits for the device once, not once per chunk and again per recompute.
    The choices (int16) and sizes are the chunks' checkpoint inputs, so a recompute routes its
    tokens exactly as the forward did."""

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(self.experts, ExpertParallel):  # no sizes: each chunk routes itself
            return super().forward(x)
        pieces = [self._cut(x, index) for index in self._pieces(x)]
        chosen = [self.choose(piece) for piece in pieces]
        counts = torch.stack([sorted_counts(c.reshape(-1).long().sort().values, self.n_experts)
                              for c in chosen])
        dispatch = self.experts.dispatch(counts, [c.numel() for c in chosen])
        return torch.cat([checkpoint(MoE.forward, self, piece, c, d, use_reentrant=False)
                          for piece, c, d in zip(pieces, chosen, dispatch)], dim=1)


def compile_loss_head(head):
    """`head` compiled: a ChunkedLoss compiles its per-chunk loss, any other head as a whole."""
    if isinstance(head, ChunkedLoss):
        return ChunkedLoss(head.chunk, torch.compile(_chunk_loss))
    return torch.compile(head)


def apply_loss_tiling(model: nn.Module, chunk: int) -> nn.Module:
    """The loss over chunks of `chunk` tokens (0: off)."""
    if chunk:
        model.loss_head = ChunkedLoss(chunk)
    return model


def apply_mlp_tiling(model: nn.Module, chunk: int, tp: int, sp: bool) -> nn.Module:
    """Every block's MLP over chunks of about `chunk` tokens (0: off). The module's class
    becomes TiledFeedForward (TiledMoE), as FSDP's fully_shard swaps classes: names and weights
    stay."""
    if not chunk:
        return model
    for layer in model.layers.values():
        moe = isinstance(layer.feed_forward, MoE)
        layer.feed_forward.__class__ = TiledMoE if moe else TiledFeedForward
        layer.feed_forward.chunk = chunk
        layer.feed_forward.shard_groups = tp if (sp and tp > 1) else 1
    return model
