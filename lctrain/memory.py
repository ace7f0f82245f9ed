"""Activation memory: what a forward pass leaves alive for the backward, measured per layer.

`measure_activations(model, run_forward)` watches every tensor that an op creates during the
forward (a TorchDispatchMode, so it sees DTensor local shards, checkpointing and custom autograd
functions alike, on any device) and, once the forward returns, adds up the storages that are
still alive: exactly the memory kept for the backward, attributed to the block that created it.
`activation_formula` is the closed form for this model (see its docstring), in the spirit of
Korthikanti et al. Table 2.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Tracker(TorchDispatchMode):
    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude  # parameter storages: views of weights are not activations
        self.where = "other"
        self.created: list[tuple[str, weakref.ref, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            # unwrap DTensor (the shard this rank holds) and async collective results
            t = getattr(t, "_local_tensor", t)
            t = getattr(t, "elem", t)
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if storage.data_ptr() in self.exclude:
                    continue
                self.created.append((self.where, weakref.ref(t), storage.data_ptr(),
                                     storage.nbytes()))
        return out


def measure_activations(model: nn.Module, run_forward) -> dict[str, int]:
    """Bytes alive after `run_forward()` (which must keep its output alive, e.g. return the loss)
    that ops created during it, per layer id ('other' for embedding, head and loss)."""
    tracker = _Tracker({_local(p).untyped_storage().data_ptr() for p in model.parameters()})
    hooks = []
    for name, layer in model.layers.items():
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, name=name: setattr(tracker, "where", name)))
        hooks.append(layer.register_forward_hook(
            lambda m, a, o: setattr(tracker, "where", "other")))
    try:
        with tracker:
            keep = run_forward()
    finally:
        for h in hooks:
            h.remove()
    alive: dict[int, tuple[str, int]] = {}
    for where, ref, ptr, nbytes in tracker.created:
        if ref() is not None and ptr not in alive:
            alive[ptr] = (where, nbytes)
    del keep
    per_layer: dict[str, int] = defaultdict(int)
    for where, nbytes in alive.values():
        per_layer[where] += nbytes
    return dict(per_layer)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def activation_formula(cfg, world_size: int, batch: int) -> float:
    """Bytes one block keeps for the backward on one rank, float32 (no autocast).

    n = batch * S / cp local tokens; t = tp; s = t with SP, else 1; D, F model and SwiGLU
    widths, D_kv = H_kv * d, H heads, r KV replication (Ulysses). Per token, in elements:
      none:      2 (D + 1)/s + 2 D + 2 D/s + (2 D + 2 r D_kv + H + 4 F)/t  [+ D/t Ulysses/USP]
                 norms (rsqrt, normalised x on the sequence shard; the (gathered) norm output
                 kept by the column-parallel matmuls), residual stream and block output, then
                 q, k, v, attention output, lse and the four SwiGLU tensors on the TP shard.
                 All-gather KV keeps the gathered K/V: 2 D_kv (cp - 1)/t more, and in every
                 mode its int64 key positions (8 S bytes).
      selective: (D + 2 D_kv + 2 F)/t + 2 D + D/s  (matmul outputs, before any KV
                 replication; the two row-parallel partial sums at full width; the block input),
                 plus (D + H)/t for the attention output and lse when cp = 1 (context-parallel
                 attention is recomputed instead).
      full:      D/s (the block input only).
    """
    from lctrain.config import derive

    m, p = cfg.model, cfg.parallel
    dv = derive(cfg, world_size)
    n = batch * cfg.train.seq_len // p.cp
    D, F, H, hd = m.dim, m.ffn_dim, m.n_heads, m.dim // m.n_heads
    t, r = p.tp, dv.kv_replication
    s = t if (p.sp and t > 1) else 1
    dkv = m.n_kv_heads * hd
    ulysses = p.cp > 1 and p.attention in ("ulysses", "usp")
    mode = cfg.train.activation_checkpointing
    allgather = p.cp > 1 and p.attention == "allgather"
    extra = 8.0 * cfg.train.seq_len if allgather else 0.0  # int64 key positions
    if mode == "full":
        return 4.0 * n * D / s + extra
    if mode == "selective":  # local attention: its output and lse are kept too
        attention = n * H * (hd + 1) / t if p.cp == 1 else 0.0
        return 4.0 * (n * ((D + 2 * dkv + 2 * F) / t + 2 * D + D / s) + attention) + extra
    per_token = 2 * (D + 1) / s + 2 * D + 2 * D / s + (2 * D + 2 * r * dkv + H + 4 * F) / t
    if ulysses:
        per_token += D / t
    if allgather:
        per_token += 2 * dkv * (p.cp - 1) / t
    return 4.0 * n * per_token + extra


def measure_block_activations(cfg, batch: int, seed: int = 0) -> float:
    """Bytes one block keeps for the backward on this rank, measured on the layout of `cfg`
    (call on every rank of an initialised world; the model is built as training builds it)."""
    from lctrain.build import build_attention, build_model, setup_distributed
    from lctrain.data.batch import micro_batch_from_tokens
    from lctrain.parallelize import apply_activation_checkpointing, apply_tensor_parallel

    rt = setup_distributed(cfg)
    model = build_model(cfg, rt.device, build_attention(cfg, rt))
    if cfg.parallel.tp > 1:
        model = apply_tensor_parallel(model, rt.mesh["tp"], cfg.parallel.sp)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing, cfg.parallel.cp)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(1, cfg.model.vocab_size, (batch, cfg.train.seq_len + 1), generator=gen)
    p = cfg.parallel
    mb = micro_batch_from_tokens(x, cfg.train.seq_len, rt.topology.axis_rank(rt.rank, "cp"), p.cp,
                                 p.load_balance, document_masking=cfg.data.document_masking)
    # The smaller of two forwards: once in a few dozen runs one more tensor (the size of the
    # local q, seen with tp=2; what holds it was not found) is alive when liveness is read,
    # and it is not there on the next forward, so it is not kept for the backward.
    per_block = []
    for _ in range(2):
        per_layer = measure_activations(model, lambda: model(mb.inputs, mb.positions,
                                                             mb.doc_ids))
        per_block.append(sum(v for k, v in per_layer.items() if k != "other"))
    return min(per_block) / cfg.model.n_layers
