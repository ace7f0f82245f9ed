"""Expert parallelism (parallel.ep, docs/parallelism.md §28), applied from outside the model as a
parallel style around each mixture-of-experts layer's `Experts` module: the experts split over
the ep ranks of an (edp, ep) unflattening of the dp x cp x tp ranks, the rows carried to their
experts' ranks before the module's own computation and back after it (all-to-all, counted under
the traffic tag "ep"). The model's code stays single-device: `lctrain.models.moe` computes the
experts it holds over the rows it is given.

A rank's experts are a DTensor sharded by expert (Shard(0) of the [E, ...] matrices) on the ep
mesh, so initialisation, Hugging Face loading, checkpoints and export see the whole [E, ...]
tensors; FSDP then shards them over edp (`lctrain.parallel.data_parallel.apply_fsdp`). The
attention's layout is unchanged: each data and context rank routes its own tokens.

The style is a class swap, as FSDP's and the tiling's: each Experts module becomes an instance
of `ExpertParallel` mixed into its own class (a family's experts keep their MLP), with its ep
group; names, parameters and checkpoints stay.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lctrain import device
from lctrain.comm import all_to_all_rows_autograd, sum_passing_grad, traffic_tag
from lctrain.config import ModelConfig
from lctrain.models.moe import Experts, table_loss
from lctrain.parallel.runtime import Runtime
from lctrain.parallel.tensor import shard_rows

EP_TAG = "ep"
"""The traffic tag of the experts' all-to-all (metrics' traffic/ep)."""


def routing_loss(table: Tensor, m: ModelConfig, rt: Runtime) -> Tensor:
    """The load-balancing loss of a micro-batch (docs/parallelism.md §28) from this rank's
    routing table (`lctrain.models.moe.RouterLog.table`), summed first over the ranks that hold
    the micro-batch's other tokens: cp, and tp (under SP each TP rank routes its own sequence
    shard). The sum passes the gradient through unchanged: each of those ranks adds the same
    loss and back-propagates its own tokens' part."""
    for axis in ("cp", "tp"):
        if rt.topology.group_size(axis) > 1:
            table = sum_passing_grad(table, rt.group(axis))
    return table_loss(table, m.n_experts)


class Dispatch(NamedTuple):
    """What one call's all-to-all over the ep group needs: the rows this rank's experts receive
    from each rank [ep, E/ep] (on the device) and, on the host, the rows this rank sends to each
    expert and receives for each (source rank, own expert), flattened [E] each."""

    received: Tensor
    sent_sizes: list[int]
    received_sizes: list[int]


class ExpertParallel:
    """Mixed into an `Experts` class: its rows reach their experts over `group` and come back.
    `forward`'s `ahead` is a `Dispatch` when `dispatch` made it already (a tiled layer's chunks:
    `lctrain.parallel.tiling.TiledMoE`)."""

    group: dist.ProcessGroup
    """The ep group."""

    def forward(self, xs: Tensor, counts: Tensor, ahead: Dispatch | None = None) -> Tensor:
        """Each expert's MLP over its rows of xs [N k, D] (sorted by expert; counts [E]), the
        rows computed on their experts' ranks."""
        with traffic_tag(EP_TAG):
            if ahead is None:
                (ahead,) = self.dispatch(counts[None], [xs.shape[0]])
            return self._dispatched(xs, ahead, self.local_weights(xs.dtype))

    def dispatch(self, counts: Tensor, rows: list[int]) -> list[Dispatch]:
        """The `Dispatch` of each of C calls, from their tokens per expert [C, E] (call c sends
        rows[c] rows): one exchange of the counts over the ep group, and one host read for all
        C calls (NCCL's uneven all-to-all takes its split sizes as numbers)."""
        ep = dist.get_world_size(self.group)
        local = self.n_experts // ep
        sent = counts.reshape(-1, ep, local).transpose(0, 1).contiguous()  # [rank, call, expert]
        received = torch.empty_like(sent)  # [source rank, call, my expert]
        dist.all_to_all_single(received, sent, group=self.group)
        both = torch.stack([sent.transpose(0, 1), received.transpose(0, 1)], dim=1)
        sizes = device.counts(both.reshape(len(rows), 2, ep * local),
                              [n for n in rows for _ in range(2)])
        return [Dispatch(received[:, c], *sizes[c]) for c in range(len(rows))]

    def _dispatched(self, xs: Tensor, dispatch: Dispatch, weights: list[Tensor]) -> Tensor:
        ep, local = dispatch.received.shape
        by_rank = [[sizes[r * local:(r + 1) * local] for r in range(ep)]
                   for sizes in (dispatch.sent_sizes, dispatch.received_sizes)]
        send, receive = [sum(row) for row in by_rank[0]], [sum(row) for row in by_rank[1]]
        rows = all_to_all_rows_autograd(xs, self.group, send, receive)
        # from (source, expert) order to (expert, source) order and back
        segment = torch.repeat_interleave(torch.arange(ep * local, device=xs.device),
                                          dispatch.received.reshape(-1),
                                          output_size=sum(receive))
        order = torch.argsort((segment % local) * ep + segment // local, stable=True)
        mine = [sum(column) for column in zip(*by_rank[1])]  # rows for each of my experts
        out = self.mlp(rows[order], dispatch.received.sum(dim=0), *weights, splits=mine)
        out = torch.empty_like(out).index_copy_(0, order, out)
        return all_to_all_rows_autograd(out, self.group, receive, send)


@cache
def _expert_parallel_class(cls: type) -> type:
    """`cls` with `ExpertParallel` before it, made once per class."""
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})


def expert_modules(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, tp: int) -> nn.Module:
    """Each Experts module of `model` (on the meta device) keeps its 1/ep of the experts (every
    parameter of the module is stacked by expert), as DTensors sharded by expert on
    mesh["ep"], and dispatches over its group; its gradients are scaled by tp/ep (§28: each
    rank's loss is scaled for an average over dp x cp, FSDP averages the experts' over the
    dp x cp x tp / ep ranks that hold them)."""
    ep = mesh["ep"].size()
    for experts in expert_modules(model):
        experts.grad_scale = tp / ep
        if ep == 1:
            continue
        for name, whole in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, shard_rows(whole, mesh["ep"]))
        experts.__class__ = _expert_parallel_class(type(experts))
        experts.group = mesh["ep"].get_group()
    return model
