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

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.delta_rule import CHUNK, chunk_gated_delta_rule, initial_states
from lctrain.comm import all_gather, reduce_scatter


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
    order, continues = [], []
    for b in range(rows):
        starts = sorted((int((pos if pos.dim() == 1 else pos[b])[span.start]), rank, slot)
                        for rank, pos in enumerate(positions)
                        for slot, span in enumerate(per_rank[rank][b]))
        order.append([(rank, slot) for _, rank, slot in starts])
        continues.append([doc_ids[b, at] == doc_ids[b, at - 1] if at else
                          torch.tensor(False) for at, _, _ in starts])
    slots = max(len(runs) for rank in per_rank for runs in rank)
    return StretchPlan([per_rank[me][b] for b in range(rows)], order, continues, slots)


def state_passing_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             doc_ids: Tensor, plan: StretchPlan, group: dist.ProcessGroup,
                             chunk: int = CHUNK) -> Tensor:
    """The gated delta rule over this rank's tokens, exact for the whole sequence.

    q, k, v, g, beta, doc_ids: this rank's tokens, shaped as `chunk_gated_delta_rule` takes
    them ([B, S_local, ...]); `plan`: `stretch_plan`'s. Returns [B, S_local, H, d_v]."""
    parts = (q, k, v, g, beta)

    def run(b: int, span: slice, start: Tensor | None = None, transition: bool = False):
        return chunk_gated_delta_rule(*(x[b:b + 1, span] for x in parts),
                                      doc_ids=doc_ids[b:b + 1, span], initial_state=start,
                                      chunk=chunk, transition=transition)

    b_rows, h, d_k, d_v = v.shape[0], v.shape[2], k.shape[-1], v.shape[-1]
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
