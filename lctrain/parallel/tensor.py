"""Tensor parallelism with Megatron sequence parallelism, as a declarative DTensor plan.

Megatron TP (docs/parallelism.md §2): wq/wk/wv and w1/w3 are column-parallel (each TP rank owns a
slice of heads / hidden units), wo and w2 row-parallel (partial sums). With SP the per-token
regions (norms, residual adds) hold [B, S/(cp*tp), D]: the row-parallel outputs reduce-scatter
along the sequence and the column-parallel inputs all-gather it, so no all-reduce is left in a
block. Without SP the row-parallel outputs all-reduce. The embedding is vocab-parallel (row-wise),
the output layer column-parallel over the vocabulary; the loss then runs vocab-parallel
(`loss_parallel`), so no rank materialises full-vocabulary logits. A mixture-of-experts block
(with SP) routes each rank's sequence shard itself (`moe_block_plan`); attention sinks shard by
heads, and so does a Gated DeltaNet mixer (`linear_block_plan`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from lctrain.models.families import FamilyCode
from lctrain.models.moe import MoE
from lctrain.models.parts import HEADS_DIM
from lctrain.models.registry import family_code


def tp_plan(sp: bool, family: FamilyCode) -> tuple[dict, dict]:
    """(top-level plan, per-block plan): module name -> parallel style, with the entries of the
    family's parts (`FamilyCode.tp_plan`). The attention and feed-forward modules take the hidden
    state as their only positional input (RoPE tables and document ids are keywords, which the
    plan leaves alone). Biases shard with their columns (ColwiseParallel's Shard(0))."""
    seq = Shard(1) if sp else Replicate()  # layout of the hidden state between blocks
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                  use_local_output=False),
    }
    block = {
        "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(
            Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(
            Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        **family.tp_plan(),
    }
    if sp:
        top["norm"] = SequenceParallel()
        block["attention_norm"] = SequenceParallel()
        block["ffn_norm"] = SequenceParallel()
        for norm in family.block_norms:  # on a sublayer's output: added to the local residual
            block[norm] = SequenceParallel(use_local_output=True)
    return top, block


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> nn.Module:
    """Shard a model (of any family) in place over `tp_mesh`; returns it. Logits come out as a
    vocab-sharded DTensor [B, S/cp, V] (Shard(-1)) for the vocab-parallel loss."""
    top, block = tp_plan(sp, family_code(model.cfg))
    seq = Shard(1) if sp else Replicate()
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    for layer in model.layers.values():
        plan = block
        if isinstance(layer.feed_forward, MoE):
            plan = moe_block_plan(plan, layer.feed_forward.shared_expert is not None)
        if layer.mixer_name != "attention":
            plan = linear_block_plan(plan, layer.mixer, seq)
            for name in ("dt_bias", "A_log"):  # one per value head, with the heads
                setattr(layer.mixer, name, shard_rows(getattr(layer.mixer, name), tp_mesh))
            conv = layer.mixer.conv1d  # a kernel per channel, grouped by key head
            conv.weight = shard_rows(conv.weight, tp_mesh)
        parallelize_module(layer, tp_mesh, plan)
        if layer.mixer_name == "attention" and layer.attention.sinks is not None:
            # one sink per query head: sharded by heads like the queries
            layer.attention.sinks = shard_rows(layer.attention.sinks, tp_mesh)
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items()
                                        if getattr(model, k.split(".")[0], None) is not None})
    if tied:  # both shard the [V, D] weight's rows (Shard(0)): one vocab-sharded weight again
        model.output.weight = model.tok_embeddings.weight
    return model


def moe_block_plan(block: dict, shared_expert: bool = False) -> dict:
    """A block plan whose MLP is a mixture of experts (with SP, which validation requires): the
    MoE takes this rank's sequence shard as a local tensor and routes its own tokens; the
    router's weight (and a shared expert's and its gate's) is replicated, its gradient summed
    over the TP ranks (SequenceParallel, as the norms'); the experts are not TP-sharded
    (`lctrain.parallel.experts` lays them out over dp x cp x tp)."""
    plan = {k: v for k, v in block.items() if not k.startswith("feed_forward")}
    plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                              desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
    replicated = ["router"] + (["shared_expert.w1", "shared_expert.w3", "shared_expert.w2",
                                "shared_expert_gate"] if shared_expert else [])
    for name in replicated:
        plan[f"feed_forward.{name}"] = SequenceParallel(use_local_output=True)
    return plan


def linear_block_plan(block: dict, mixer: nn.Module, seq) -> dict:
    """A block plan whose token mixer is a Gated DeltaNet (docs/parallelism.md §31): split by
    heads as the attention is, its input projections column-parallel (their rows grouped by key
    head: each rank's are its key heads' and their value heads'), its output projection
    row-parallel, the per-head norm's weight replicated with its gradient summed over the TP
    ranks (the heads dimension sharded, as the attention's head norms)."""
    plan = {k: v for k, v in block.items() if k.split(".")[0] != "attention"}
    plan["linear_attention"] = PrepareModuleInput(input_layouts=(seq,),
                                                  desired_input_layouts=(Replicate(),))
    for name, _ in mixer.named_children():
        if name.startswith("in_proj_"):
            plan[f"linear_attention.{name}"] = ColwiseParallel()
    plan["linear_attention.out_proj"] = RowwiseParallel(output_layouts=seq)
    plan["linear_attention.norm"] = SequenceParallel(sequence_dim=HEADS_DIM,
                                                     use_local_output=True)
    return plan


def local_part(t: Tensor) -> Tensor:
    """This rank's part of `t` (a DTensor's local tensor, outside autograd; a plain tensor
    itself)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def laid_out_as(grad: Tensor, p: Tensor) -> Tensor:
    """`grad` with its parameter's placements (TP's row-wise embedding returns its gradient
    replicated, without a data-parallel engine to reshard it: each rank takes its rows, as
    AdamW's DTensor arithmetic would)."""
    if isinstance(grad, DTensor) and grad.placements != p.placements:
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def plus_aux(objective: Tensor, aux: Tensor) -> Tensor:
    """A loss `objective` plus a weighted load-balancing loss `aux` computed on local tensors:
    under TP the vocab-parallel loss is a DTensor replicated over tp, and so is `aux`."""
    if isinstance(objective, DTensor):
        aux = DTensor.from_local(aux, objective.device_mesh, [Replicate()])
    return objective + aux


def shard_rows(param: Tensor, mesh: DeviceMesh) -> nn.Parameter:
    """A parameter like `param` (on the meta device) sharded by rows (Shard(0)) over `mesh`:
    this rank's 1/size of them, uninitialised (the sharded model is filled after it is laid
    out)."""
    local = torch.empty((param.shape[0] // mesh.size(), *param.shape[1:]), dtype=param.dtype,
                        device=param.device)
    return nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                           shape=param.shape, stride=param.stride()))


def vocab_parallel(tp: int) -> contextlib.AbstractContextManager:
    """The context a loss (forward and backward) runs in with tensor parallelism `tp`: the
    logits are vocab-sharded [B, S/cp, V/tp] (docs/parallelism.md §2, §10) and the
    cross-entropy, forward and backward, is vocab-parallel, so no rank holds all of V."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def loss_value(loss: Tensor) -> Tensor:
    """The plain tensor of a loss (a DTensor loss is replicated over tp)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
