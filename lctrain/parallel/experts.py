"""Expert parallelism (parallel.ep, docs/parallelism.md §28): every mixture-of-experts layer's
experts split over the ep ranks of an (edp, ep) unflattening of the dp x cp x tp ranks. A rank's
experts are a DTensor sharded by expert (Shard(0) of the [E, ...] matrices) on the ep mesh, so
initialisation, Hugging Face loading, checkpoints and export see the whole [E, ...] tensors;
FSDP then shards them over edp (`lctrain.parallel.data_parallel.apply_fsdp`). The rows reach
their experts and come back by all-to-all (`lctrain.models.moe.Experts`). The attention's layout
is unchanged: each data and context rank routes its own tokens.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lctrain.models.llama import Llama
from lctrain.models.moe import Experts
from lctrain.parallel.tensor import shard_rows


def expert_modules(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def apply_expert_parallel(model: Llama, mesh: DeviceMesh, tp: int) -> Llama:
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
        experts.group = mesh["ep"].get_group()
    return model
