"""Context parallelism for the gated delta rule by passing states, not tokens (docs/parallelism.md
§31): each rank runs its stretches of the sequence from a zero state and keeps, per stretch, the
final state E [B, H, d_k, d_v] and the transition T [B, H, d_k, d_k]; the ranks all-gather
these (P n pairs of H d_k (d_v + d_k) numbers, whatever the sequence length); every rank
combines them in sequence order into the exact initial state of its own stretches and runs them
again from it. The backward follows the same path in reverse: the all-gather's backward
reduce-scatters the gradients of (E, T) to the ranks that made them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain import device
from lctrain.attention.calls import PlanCache
from lctrain.attention.delta_rule import (
    CHUNK,
    DeltaRule,
    LinearHeads,
    causal_conv,
    chunk_gated_delta_rule,
    initial_states,
    split_heads,
)
from lctrain.comm import all_gather, reduce_scatter
from lctrain.layout import sequence


class _GatherStates(torch.autograd.Function):
    """x [n, ...] -> [P n, ...], every rank's in group-rank order; the backward sums the
    gradient over the ranks and gives each its own n."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter(grad.contiguous(), ctx.group, dim=0), None


class _Through(torch.autograd.Function):
    """`out` unchanged, tied to `gathered` in the graph: every rank's backward then reaches the
    gather's reduce-scatter (a collective), also a rank whose own stretches read no state (the
    first rank of a contiguous split) but whose states others read."""

    @staticmethod
    def forward(ctx, out: Tensor, gathered: Tensor) -> Tensor:
        ctx.like = (gathered.shape, gathered.dtype, gathered.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.like
        return grad, torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class StretchPlan:
    """Which stretches each rank holds and how they line up, made on the host from every rank's
    positions (each rank computes the same): per row, this rank's stretches (runs of
    consecutive positions, slices of its tokens in local order), every rank's stretches in
    sequence order as (rank, slot), and whether each continues the document before it. Every
    rank sends `slots` of them (the most any rank holds in a row): an empty slot sends zeros."""

    mine: list[list[slice]]
    order: list[list[tuple[int, int]]]
    continues: list[list[Tensor]]
    slots: int
    bounds: list[list[tuple[int, int]]]
    """Per row, the global positions [start, end) of each stretch of `order`."""

    @cached_property
    def passes(self) -> bool:
        """Whether some stretch continues a document from the stretch before it: else every
        stretch starts from a zero state and no halo (documents held whole by their ranks),
        and nothing is exchanged (the same on every rank: the plan is made from the global
        document ids)."""
        return any(bool(c) for row in self.continues for c in row)


def _runs(pos: Tensor) -> list[slice]:
    """Runs of consecutive global positions in `pos` [S_local], as slices of it."""
    cuts = [0, *((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist(), len(pos)]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


def stretch_plan(positions: list[Tensor], doc_ids: Tensor, me: int) -> StretchPlan:
    """The plan of rank `me` from every rank's global positions ([S/cp], or [B, S/cp] with a
    split per row) and the global doc_ids [B, S]."""
    rows = doc_ids.shape[0]
    per_rank = [[_runs(pos if pos.dim() == 1 else pos[b]) for b in range(rows)]
                for pos in positions]
    order, continues, bounds = [], [], []
    for b in range(rows):
        starts = sorted((int((pos if pos.dim() == 1 else pos[b])[span.start]),
                         span.stop - span.start, rank, slot)
                        for rank, pos in enumerate(positions)
                        for slot, span in enumerate(per_rank[rank][b]))
        order.append([(rank, slot) for _, _, rank, slot in starts])
        bounds.append([(at, at + n) for at, n, _, _ in starts])
        continues.append([doc_ids[b, at] == doc_ids[b, at - 1] if at else
                          torch.tensor(False) for at, _, _, _ in starts])
    slots = max(len(runs) for rank in per_rank for runs in rank)
    return StretchPlan([per_rank[me][b] for b in range(rows)], order, continues, slots, bounds)


def state_passing_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             doc_ids: Tensor, plan: StretchPlan, group: dist.ProcessGroup,
                             chunk: int = CHUNK, rule: DeltaRule = chunk_gated_delta_rule
                             ) -> Tensor:
    """The gated delta rule over this rank's tokens, exact for the whole sequence.

    q, k, v, g, beta, doc_ids: this rank's tokens, shaped as `chunk_gated_delta_rule` takes
    them ([B, S_local, ...]; doc_ids on the host or the device); `plan`: `stretch_plan`'s;
    `rule`: the rule over each stretch (`chunk_gated_delta_rule`'s contract). Returns
    [B, S_local, H, d_v]."""
    parts = (q, k, v, g, beta)

    def run(b: int, span: slice, start: Tensor | None = None, transition: bool = False):
        return rule(*(x[b:b + 1, span] for x in parts), doc_ids=doc_ids[b:b + 1, span],
                    initial_state=start, chunk=chunk, transition=transition)

    b_rows, h, d_k, d_v = v.shape[0], v.shape[2], k.shape[-1], v.shape[-1]
    if not plan.passes:  # every stretch starts a document: from zero, nothing to exchange
        return torch.cat([torch.cat([run(b, span)[0] for span in plan.mine[b]], dim=1)
                          for b in range(b_rows)])
    empty = v.new_zeros(1, h, d_k, d_v + d_k, dtype=torch.promote_types(v.dtype, torch.float32))
    slots = []
    for slot in range(plan.slots):
        rows = []
        for b in range(b_rows):
            if slot < len(plan.mine[b]):
                _, end, moved = run(b, plan.mine[b][slot], transition=True)
                rows.append(torch.cat([end, moved], dim=-1))
            else:
                rows.append(empty)
        slots.append(torch.cat(rows))
    everyone = _GatherStates.apply(torch.stack(slots), group)  # [P slots, B, H, d_k, d_v + d_k]
    me, out = dist.get_rank(group), []
    for b in range(b_rows):
        ordered = [everyone[rank * plan.slots + slot, b:b + 1] for rank, slot in plan.order[b]]
        starts = initial_states([x[..., :d_v] for x in ordered], [x[..., d_v:] for x in ordered],
                                [c.reshape(1) for c in plan.continues[b]])
        start_of = {slot: starts[at] for at, (rank, slot) in enumerate(plan.order[b])
                    if rank == me}
        out.append(torch.cat([run(b, span, start_of[slot])[0]
                              for slot, span in enumerate(plan.mine[b])], dim=1))
    return _Through.apply(torch.cat(out), everyone)


@dataclass(frozen=True)
class HaloPlan:
    """Where each of this rank's stretches finds the k - 1 inputs before it, made on the host:
    per row and stretch, indices into the gathered tails flattened to [P slots B (k - 1) + 1,
    C] (the last row zeros: positions before the row's start), and the document ids of the
    halo and the stretch together."""

    index: list[list[Tensor]]
    docs: list[list[Tensor]]


def halo_plan(plan: StretchPlan, doc_ids: Tensor, me: int, width: int) -> HaloPlan:
    """The halo of width `width` of each stretch of rank `me` (doc_ids: the global [B, S])."""
    rows = doc_ids.shape[0]
    index, docs = [], []
    for b in range(rows):
        at_of = {order: at for at, order in enumerate(plan.order[b])}
        ends = [end for _, end in plan.bounds[b]]
        row_index, row_docs = [], []
        for slot in range(len(plan.mine[b])):
            start, end = plan.bounds[b][at_of[me, slot]]
            picks, halo_docs = [], []
            for p in range(start - width, start):
                if p < 0:
                    picks.append(-1)
                    halo_docs.append(-1)  # no token's document: the convolution sees zeros
                    continue
                at = next(i for i, (a, e) in enumerate(plan.bounds[b]) if a <= p < e)
                rank, its_slot = plan.order[b][at]
                tail_row = (rank * plan.slots + its_slot) * rows + b
                picks.append(tail_row * width + width - (ends[at] - p))
                halo_docs.append(int(doc_ids[b, p]))
            row_index.append(torch.tensor(picks, dtype=torch.int64))
            row_docs.append(torch.cat([torch.tensor(halo_docs, dtype=doc_ids.dtype),
                                       doc_ids[b, start:end]]))
        index.append(row_index)
        docs.append(row_docs)
    return HaloPlan(index, docs)


def halo_conv(x: Tensor, weight: Tensor, plan: StretchPlan, halo: HaloPlan,
              group: dist.ProcessGroup) -> Tensor:
    """`causal_conv` of this rank's tokens x [B, S_local, C] as over the whole rows: each stretch
    takes the k - 1 inputs before its start from the ranks that hold them. Every rank
    all-gathers the last k - 1 inputs of each of its stretches (P slots B (k - 1) C numbers,
    whatever the sequence length; the backward reduce-scatters their gradients); a stretch then
    runs with the ones of the k - 1 positions before it prepended (`halo_plan`), their
    document ids beside: the convolution restarts at documents as on one rank."""
    width = weight.shape[-1] - 1
    rows, c = x.shape[0], x.shape[-1]
    if not plan.passes:  # every stretch starts a document: no halo to fetch
        return torch.stack([torch.cat([
            causal_conv(x[b, span][None], weight, halo.docs[b][slot][None, width:].to(x.device))[0]
            for slot, span in enumerate(plan.mine[b])]) for b in range(rows)])
    tails = x.new_zeros(plan.slots, rows, width, c)
    for b in range(rows):
        for slot, span in enumerate(plan.mine[b]):
            tail = x[b, span][-width:]
            tails[slot, b, width - tail.shape[0]:] = tail
    everyone = _GatherStates.apply(tails, group)  # [P slots, B, k - 1, C]
    flat = torch.cat([everyone.reshape(-1, c), everyone.new_zeros(1, c)])  # index -1: zeros
    out = []
    for b in range(rows):
        pieces = []
        for slot, span in enumerate(plan.mine[b]):
            before = flat[halo.index[b][slot].to(x.device)]
            docs = halo.docs[b][slot][None].to(x.device)
            pieces.append(causal_conv(torch.cat([before, x[b, span]])[None], weight,
                                      docs)[0, width:])
        out.append(torch.cat(pieces))
    return _Through.apply(torch.stack(out), everyone)


def check_cp_rank(group: dist.ProcessGroup, cp_rank: int) -> None:
    """The linear layers' cores order every rank's tokens by cp rank, the all-gather's and the
    all-to-all's by group rank: they must agree."""
    if dist.get_rank(group) != cp_rank:
        raise ValueError(f"cp rank {cp_rank} is rank {dist.get_rank(group)} of its cp group: the "
                         "linear layers' context parallelism orders the tokens by cp rank")


class StatePassing:
    """The linear-attention layers' core (`lctrain.models.gated_deltanet.LinearCore`) of a cp
    layout that passes states: the convolution by `halo_conv`, the recurrence by
    `state_passing_delta_rule`, over
    the tokens `lctrain.layout.sequence` gives each cp rank (any split; the stretch plan made
    on the host once per micro-batch's document ids)."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, seq_len: int,
                 load_balance: str, conv_kernel: int, ulysses: int = 1,
                 rule: DeltaRule = chunk_gated_delta_rule):
        check_cp_rank(group, cp_rank)
        self.rule = rule
        self.group, self.me, self.cp, self.seq_len = group, cp_rank, cp, seq_len
        self.load_balance, self.ulysses, self.width = load_balance, ulysses, conv_kernel - 1
        self._plans = PlanCache(self._plan)
        self._one_document: dict[int, Tensor] = {}

    @device.on_host
    def _plan(self, doc_ids: Tensor) -> tuple[StretchPlan, HaloPlan, Tensor]:
        """(the stretch plan, the convolution's halo, this rank's tokens' document ids
        [B, S_local])."""
        positions = sequence.every_rank_positions(self.seq_len, self.cp, self.load_balance,
                                                  doc_ids, self.ulysses)
        plan = stretch_plan(positions, doc_ids, self.me)
        return (plan, halo_plan(plan, doc_ids, self.me, self.width),
                sequence.take(doc_ids, positions[self.me], 1))

    @device.on_host
    def _documents(self, doc_ids: Tensor | None, rows: int) -> Tensor:
        """The global document ids (host tensors), one document per row when none are packed
        (made once per row count: the plan cache then finds them by identity)."""
        if doc_ids is not None:
            return doc_ids.cpu()
        if rows not in self._one_document:
            self._one_document[rows] = torch.zeros(rows, self.seq_len, dtype=torch.int64)
        return self._one_document[rows]

    def conv(self, x: Tensor, weight: Tensor, doc_ids: Tensor | None) -> Tensor:
        """`causal_conv` of this rank's x [B, S_local, C] as over the whole rows."""
        plan, halo, _ = self._plans(self._documents(doc_ids, x.shape[0]))
        return halo_conv(x, weight, plan, halo, self.group)

    def mix(self, qkv: Tensor, weight: Tensor, g: Tensor, beta: Tensor,
            doc_ids: Tensor | None, heads: LinearHeads) -> Tensor:
        plan, _, local = self._plans(self._documents(doc_ids, qkv.shape[0]))
        q, k, v = split_heads(self.conv(qkv, weight, doc_ids), heads)
        return state_passing_delta_rule(q, k, v, g, beta, local, plan, self.group,
                                        rule=self.rule)
