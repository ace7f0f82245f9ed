"""Context parallelism for the gated delta rule by passing states, not tokens (docs/parallelism.md
§31): each rank runs its stretches of the sequence from a zero state and keeps, per stretch, the
final state E [B, H, d_k, d_v] and the transition T [B, H, d_k, d_k]; the ranks all-gather
these (P n pairs of H d_k (d_v + d_k) numbers, whatever the sequence length); every rank
combines them in sequence order into the exact initial state of its own stretches and runs them
again from it. The backward follows the same path in reverse: the all-gather's backward
reduce-scatters the gradients of (E, T) to the ranks that made them.
"""

from __future__ import annotations

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


def state_passing_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                             doc_ids: Tensor, mine: list[slice],
                             sequence: list[tuple[int, int]], continues: Tensor,
                             group: dist.ProcessGroup, chunk: int = CHUNK) -> Tensor:
    """The gated delta rule over this rank's tokens, exact for the whole sequence.

    q, k, v, g, beta, doc_ids: this rank's tokens, shaped as `chunk_gated_delta_rule` takes
    them ([B, S_local, ...]); `mine`: this rank's stretches (slices of its tokens, each a run of
    consecutive positions of the sequence), the same number n on every rank; `sequence`: every
    stretch of every rank in sequence order, as (group rank, index in that rank's `mine`);
    `continues` [P n, B]: in sequence order, whether each stretch's first token continues the
    document of the token before it (False for the first). Returns [B, S_local, H, d_v]."""
    parts = (q, k, v, g, beta)
    alone = [chunk_gated_delta_rule(*(x[:, span] for x in parts), doc_ids=doc_ids[:, span],
                                    chunk=chunk, transition=True) for span in mine]
    d_v = v.shape[-1]
    packed = torch.stack([torch.cat([end, moved], dim=-1) for _, end, moved in alone])
    everyone = _GatherStates.apply(packed, group)  # [P n, B, H, d_k, d_v + d_k]
    n, me = len(mine), dist.get_rank(group)
    ordered = [everyone[rank * n + i] for rank, i in sequence]
    starts = initial_states([x[..., :d_v] for x in ordered], [x[..., d_v:] for x in ordered],
                            list(continues))
    start_of = {i: starts[at] for at, (rank, i) in enumerate(sequence) if rank == me}
    out = [chunk_gated_delta_rule(*(x[:, span] for x in parts), doc_ids=doc_ids[:, span],
                                  initial_state=start_of[i], chunk=chunk)[0]
           for i, span in enumerate(mine)]
    return _Through.apply(torch.cat(out, dim=1), everyone)
