"""THE build order of a model laid out for training: the attention core for the layout; the
model on the meta device, cut into pipeline stages under pipeline parallelism; then for the
model or each stage, tensor + sequence parallelism, activation checkpointing and FSDP, in
that order; each rank's shards materialised and filled (seeded init or Hugging Face weights);
DDP last. The training loop, the memory measurement, benchmarks and tests all build through
here, so every caller gets the layout training gets.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from lctrain import device
from lctrain.attention import ContextParallelAttention
from lctrain.attention.delta_cp import StatePassing
from lctrain.attention.delta_heads import HeadSplit
from lctrain.attention.delta_rule import delta_rule
from lctrain.attention.kernels import KernelOptions, forward_ops
from lctrain.config import LctrainConfig
from lctrain.config.derived import load_balance_of
from lctrain.models.blocks import AttentionCore, sdpa_attention
from lctrain.models.decoder import Decoder
from lctrain.models.gated_deltanet import LinearCore, LocalLinear
from lctrain.models.hf import load_hf_weights
from lctrain.models.init import init_weights
from lctrain.models.registry import new_model
from lctrain.parallel.checkpointing import apply_activation_checkpointing
from lctrain.parallel.data_parallel import apply_ddp, apply_fsdp, data_parallel_engine
from lctrain.parallel.experts import apply_expert_parallel
from lctrain.parallel.pipeline import PipelinedModel, my_stages, stage_model
from lctrain.parallel.runtime import Runtime
from lctrain.parallel.tensor import apply_tensor_parallel
from lctrain.parallel.tiling import apply_loss_tiling, apply_mlp_tiling, compile_loss_head


def attention_options(cfg: LctrainConfig) -> KernelOptions:
    """The kernel backend and determinism the config asks for."""
    return KernelOptions(backend=cfg.train.attention_kernel,
                         deterministic=cfg.train.deterministic)


def build_attention_core(cfg: LctrainConfig, rt: Runtime) -> AttentionCore:
    """The attention core the model calls: PyTorch's SDPA for plain local attention, else
    lctrain's kernels (the configured cp algorithm; at cp = 1 the local path that plans packed
    documents once per micro-batch, that honours train.deterministic on CUDA, or that runs the
    train.attention_kernel named)."""
    if cfg.parallel.cp == 1 and not (cfg.data.document_masking or (
            cfg.train.deterministic and device.gpu_path(rt.device))
            or cfg.train.attention_kernel != "auto"):
        return sdpa_attention
    return ContextParallelAttention(cfg.parallel.attention, rt.cp_groups, cfg.train.seq_len,
                                    load_balance_of(cfg),
                                    kv_replication=rt.derived.kv_replication,
                                    options=attention_options(cfg))


def build_linear_core(cfg: LctrainConfig, rt: Runtime) -> LinearCore:
    """The linear-attention layers' core: the whole rows on one rank, or under context
    parallelism (parallel.linear_cp) state passing or the head split over the cp group (the
    tokens each rank holds laid out as the attention's); the rule on the kernels
    train.linear_kernel names."""
    rule = delta_rule(cfg.train.linear_kernel, rt.device)
    if cfg.parallel.cp == 1:
        return LocalLinear(rule)
    g, where = rt.cp_groups, (cfg.train.seq_len, load_balance_of(cfg))
    if cfg.parallel.linear_cp == "heads":
        return HeadSplit(g.cp, g.cp_rank, g.cp_size, *where, g.ulysses_size, rule)
    return StatePassing(g.cp, g.cp_rank, g.cp_size, *where, cfg.model.linear_conv_kernel,
                        g.ulysses_size, rule)


def parallelize_model(model: Decoder, cfg: LctrainConfig, rt: Runtime,
                      fill: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Apply TP + SP, expert parallelism, sequence tiling, activation checkpointing, then FSDP
    over dp x cp (a rank's experts over the ranks holding the same ones); then,
    for a model built on the meta device, materialise this rank's shards on the device and
    `fill` them; then DDP (which needs real weights). Under context parallelism a mixture of
    experts' routing tables are summed over the ranks of a micro-batch by the step
    (`lctrain.parallel.experts.routing_loss`)."""
    p, t = cfg.parallel, cfg.train
    if p.tp > 1:
        model = apply_tensor_parallel(model, rt.mesh["tp"], p.sp)
    if p.ep > 1 or (p.tp > 1 and cfg.model.n_experts):
        model = apply_expert_parallel(model, rt.mesh.experts(p.ep), p.tp)
    model = apply_mlp_tiling(apply_loss_tiling(model, t.loss_chunk), t.mlp_chunk, p.tp, p.sp)
    model = apply_activation_checkpointing(
        model, t.activation_checkpointing, p.cp,
        forward_ops(attention_options(cfg).backend_for(rt.device)))
    if t.compile:
        model = apply_compile(model, p.tp)
    engine = data_parallel_engine(cfg, rt)
    if engine == "fsdp":
        model = apply_fsdp(model, rt, offload=p.offload_state == "optimizer+params")
    if fill is not None:
        _materialize(model, rt.device, fill)
    return apply_ddp(model, rt) if engine == "ddp" else model


def apply_compile(model: Decoder, tp: int) -> Decoder:
    """torch.compile each block in place (names and hooks kept: TP's, checkpointing's, and
    FSDP's, which come after), and the loss head without TP (the vocab-parallel loss stays
    eager)."""
    for layer in model.layers.values():
        layer.compile()
    if tp == 1:
        model.loss_head = compile_loss_head(model.loss_head)
    return model


def _materialize(model: nn.Module, on: torch.device,
                 fill: Callable[[nn.Module], None]) -> None:
    """Storage for this rank's shards on `on` (uninitialised; `lctrain.device.allocate`),
    buffers computed, then the values from `fill` (in a trace, whose fake tensors hold no
    values, none)."""
    device.allocate(model, on)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    if device.holds_values():
        fill(model)


def build_model(cfg: LctrainConfig, rt: Runtime) -> nn.Module:
    """The model of `cfg` on this rank, laid out for training. It is built on the meta device
    and parallelized there; then each rank allocates only its shards and fills them: from
    model.init_from (each rank reads only its slices) or from train.seed (the same global
    weights for every layout, lctrain.models.init). With pipeline parallelism the model is cut
    into stages first and each of this rank's stages is laid out like a whole model."""
    core = build_attention_core(cfg, rt)  # host tensors: outside the meta device
    linear = build_linear_core(cfg, rt)
    fill = partial(_fill, cfg)
    if rt.topology.pp > 1:
        parts = {stage: parallelize_model(stage_model(cfg, core, stage, linear), cfg, rt,
                                          fill=fill)
                 for stage in my_stages(cfg, rt)}
        return PipelinedModel(parts, cfg, rt)
    with torch.device("meta"):
        model = new_model(cfg.model, core, linear)
    return parallelize_model(model, cfg, rt, fill=fill)


def _fill(cfg: LctrainConfig, model: nn.Module) -> None:
    if cfg.model.init_from is not None:
        load_hf_weights(model, cfg.model.init_from)
    else:
        init_weights(model, cfg.train.seed)
