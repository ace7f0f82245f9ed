"""Context parallelism for Gated DeltaNet layers by splitting the heads (docs/parallelism.md §31):
the alternative to passing states, as Megatron-LM runs its linear layers. An all-to-all turns
each rank's tokens of every head into every token of its share of the heads (the projected
Q, K, V channels before the convolution, the decays and write strengths); each rank then runs
the convolution and the recurrence over whole rows for its heads, and a second all-to-all
brings the output back to the rank's tokens. What it sends grows with the sequence (each rank
sends (P - 1)/P of its tokens' C_c + 2 H_v + H_v d_v numbers per layer, and as many in the
backward); state passing sends the same at any length. The heads must divide the ranks.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain import device
from lctrain.attention.calls import PlanCache
from lctrain.attention.delta_cp import check_cp_rank
from lctrain.attention.delta_rule import (
    DeltaRule,
    LinearHeads,
    chunk_gated_delta_rule,
    gated_delta_mix,
)
from lctrain.comm import all_to_all_autograd
from lctrain.layout import sequence


@cache  # every layer and micro-batch asks for the same
def head_channels(heads: LinearHeads, ranks: int) -> Tensor:
    """[P, C / P]: the convolution channels of each rank's share of the heads, its query heads'
    then its key heads' then its value heads' (the layout `split_heads` reads; host)."""
    q, k = heads.key_heads * heads.key_dim, heads.key_heads * heads.key_dim
    ids = torch.arange(heads.channels)
    parts = (ids[:q].view(ranks, -1), ids[q:q + k].view(ranks, -1), ids[q + k:].view(ranks, -1))
    return torch.cat(parts, dim=1)


class HeadSplit:
    """The linear-attention layers' core (`lctrain.models.gated_deltanet.LinearCore`) of a cp
    layout that splits the heads: the tokens each rank holds as `lctrain.layout.sequence` lays
    them out (any split), put in position order after the all-to-all (an order made on the host
    once per micro-batch's document ids)."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, seq_len: int,
                 load_balance: str, ulysses: int = 1, rule: DeltaRule = chunk_gated_delta_rule):
        check_cp_rank(group, cp_rank)
        self.rule = rule
        self.group, self.me, self.cp, self.seq_len = group, cp_rank, cp, seq_len
        self.load_balance, self.ulysses = load_balance, ulysses
        self._orders = PlanCache(self._order)

    @device.on_host
    def _order(self, doc_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """(position order of the tokens as the all-to-all gathers them, in cp-rank order, and
        its inverse): [S], or [B, S] with a split per row."""
        positions = torch.cat(sequence.every_rank_positions(
            self.seq_len, self.cp, self.load_balance, doc_ids, self.ulysses), dim=-1)
        order = positions.argsort(dim=-1)
        return order, order.argsort(dim=-1)

    def mix(self, qkv: Tensor, weight: Tensor, g: Tensor, beta: Tensor,
            doc_ids: Tensor | None, heads: LinearHeads) -> Tensor:
        p, (b, n, _) = self.cp, qkv.shape
        if heads.key_heads % p:
            raise ValueError(f"the head split needs the key heads ({heads.key_heads}) to divide "
                             f"over the {p} cp ranks")
        docs = None if doc_ids is None else doc_ids.cpu()
        order, inverse = self._orders(docs)
        channels = head_channels(heads, p)
        # [B, n, P, C/P]: each rank's heads' channels -> [B, S, C/P] in cp-rank order
        x = all_to_all_autograd(qkv[..., channels.flatten().to(qkv.device)].view(b, n, p, -1),
                                self.group, scatter_dim=2, gather_dim=1)[:, :, 0]
        rates = torch.stack([g, beta.to(g.dtype)], dim=-1).view(b, n, p, -1, 2)
        rates = all_to_all_autograd(rates, self.group, scatter_dim=2, gather_dim=1)[:, :, 0]
        x, rates = (sequence.take(t, order, 1) for t in (x, rates))  # position order
        mine = LinearHeads(heads.key_heads // p, heads.key_dim, heads.value_heads // p,
                           heads.value_dim)
        out = gated_delta_mix(x, weight[channels[self.me].to(weight.device)], rates[..., 0],
                              rates[..., 1].to(beta.dtype), docs, mine, self.rule)
        out = sequence.take(out, inverse, 1)  # [B, S, H_v/P, d_v] in cp-rank order
        return all_to_all_autograd(out, self.group, scatter_dim=1, gather_dim=2)
