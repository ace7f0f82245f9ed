"""THE build order of a model laid out for training: the attention core for the layout, then
tensor + sequence parallelism, activation checkpointing and data parallelism, in that order, and
finally the starting weights. The training loop, the memory measurement, benchmarks and tests
all build through here, so every caller gets the layout training gets.
"""

from __future__ import annotations

from torch import nn

from lctrain.attention import ContextParallelAttention
from lctrain.attention.kernels import KernelOptions
from lctrain.config import LctrainConfig
from lctrain.models.hf import load_hf_weights
from lctrain.models.llama import AttentionCore, Llama, sdpa_attention
from lctrain.parallel.checkpointing import apply_activation_checkpointing
from lctrain.parallel.data_parallel import apply_data_parallel, unwrap
from lctrain.parallel.runtime import Runtime
from lctrain.parallel.tensor import apply_tensor_parallel


def build_attention_core(cfg: LctrainConfig, rt: Runtime) -> AttentionCore:
    """The attention core the model calls: PyTorch's SDPA for plain local attention, else
    lctrain's kernels (the configured cp algorithm; at cp = 1 the local path that plans packed
    documents once per micro-batch, or that honours train.deterministic on CUDA)."""
    options = KernelOptions(deterministic=cfg.train.deterministic)
    if cfg.parallel.cp == 1 and not (cfg.data.document_masking or (
            cfg.train.deterministic and rt.device.type == "cuda")):
        return sdpa_attention
    return ContextParallelAttention(cfg.parallel.attention, rt.cp_groups, cfg.train.seq_len,
                                    cfg.parallel.load_balance,
                                    kv_replication=rt.derived.kv_replication, options=options)


def parallelize_model(model: Llama, cfg: LctrainConfig, rt: Runtime) -> nn.Module:
    """Apply TP + SP, then activation checkpointing, then FSDP or DDP over dp x cp."""
    if cfg.parallel.tp > 1:
        model = apply_tensor_parallel(model, rt.mesh["tp"], cfg.parallel.sp)
    model = apply_activation_checkpointing(model, cfg.train.activation_checkpointing,
                                           cfg.parallel.cp)
    return apply_data_parallel(model, cfg, rt)


def build_model(cfg: LctrainConfig, rt: Runtime) -> nn.Module:
    """The model of `cfg` on this rank, laid out for training: initialised from train.seed
    (identically on every rank), parallelized, then loaded from model.init_from if set (each
    rank reads only the slices it holds)."""
    model = Llama(cfg.model, build_attention_core(cfg, rt))
    model.init_weights(cfg.train.seed)
    model = parallelize_model(model.to(rt.device), cfg, rt)
    if cfg.model.init_from is not None:
        load_hf_weights(unwrap(model), cfg.model.init_from)
    return model
