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
from torch.utils._pytree import tree_flatten, tree_map

from lctrain.config import LctrainConfig
from lctrain.data.batch import micro_batch_from_tokens
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed

# Ops that hand tensors to a process group: functional collectives (DTensor) and the c10d ops
# behind torch.distributed's collectives (context-parallel attention).
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


def _call_collective(func, args, kwargs):
    """Run a collective so that the process group holds none of the tensor objects the tracker
    watches. A gloo Work keeps the tensors it was given (input and output) until its worker
    thread drops the Work, which it does after the Work signalled completion: wait() returns
    first and the release follows later (microseconds to milliseconds: that thread must be
    scheduled and take the GIL). Read right after the forward, the buffers of the last
    collective were thus sometimes still alive (about one forward in 30). The collective gets,
    and its caller gets back, aliases: new tensor objects on the same storage (wait_tensor's work
    registry is keyed by storage), so the Work holds only its own aliases and what the tracker
    watches lives exactly as long as the model and autograd keep it."""
    originals: dict[int, torch.Tensor] = {}

    def hide(t):
        if type(t) is not torch.Tensor:
            return t
        alias = torch.ops.aten.alias.default(t)
        originals[id(alias)] = t
        return alias

    args, kwargs = tree_map(hide, (args, kwargs))
    out = func(*args, **kwargs)
    # an argument returned as is (in-place collectives, wait_tensor) goes back as the original;
    # a new tensor (a functional collective's output) as an alias the Work does not hold
    return tree_map(lambda t: originals[id(t)] if id(t) in originals else hide(t), out)


class _Tracker(TorchDispatchMode):
    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude  # parameter storages: views of weights are not activations
        self.where = "other"
        self.created: list[tuple[str, weakref.ref]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
            out = _call_collective(func, args, kwargs or {})
        else:
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
    tracker = _Tracker(_parameter_storages(model))
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
    # Storages are read now, not when created: FSDP frees a block's gathered weights after its
    # forward (size 0; their memory may since hold an activation) and keeps the root's gathered
    # weights as the module's parameters until the backward: weights, not activations.
    weights = _parameter_storages(model)
    alive: dict[int, tuple[str, int]] = {}
    for where, ref in tracker.created:
        t = ref()
        if t is None:
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in alive and ptr not in weights:
            alive[ptr] = (where, storage.nbytes())
    del keep
    per_layer: dict[str, int] = defaultdict(int)
    for where, nbytes in alive.values():
        per_layer[where] += nbytes
    return dict(per_layer)


def _parameter_storages(model: nn.Module) -> set[int]:
    """Data pointers of the storages the model's parameters use now (local shards of DTensors,
    FSDP's gathered weights while they are registered)."""
    return {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
            for p in model.parameters()}


def build_measured_model(cfg: LctrainConfig, batch: int, seed: int = 0):
    """(model, run_forward) on the layout of `cfg`, the model built as training builds it (call
    on every rank of an initialised world); run_forward() runs one forward on a fixed batch."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(1, cfg.model.vocab_size, (batch, cfg.train.seq_len + 1), generator=gen)
    p = cfg.parallel
    mb = micro_batch_from_tokens(x, cfg.train.seq_len, rt.axis_rank("cp"), p.cp,
                                 p.load_balance, document_masking=cfg.data.document_masking)
    return model, lambda: model(mb.inputs, mb.positions, mb.doc_ids)


def measure_block_activations(cfg: LctrainConfig, batch: int, seed: int = 0) -> float:
    """Bytes one block keeps for the backward on this rank, measured with one forward on the
    layout of `cfg` (call on every rank of an initialised world)."""
    model, run_forward = build_measured_model(cfg, batch, seed)
    per_layer = measure_activations(model, run_forward)
    return sum(v for k, v in per_layer.items() if k != "other") / cfg.model.n_layers
