"""Activation memory measured: what a forward pass leaves alive for the backward, per layer, on
a model laid out exactly as training lays it out.

`measure_activations(model, run_forward)` watches every tensor that an op creates during the
forward (a TorchDispatchMode, so it sees DTensor local shards, checkpointing and custom autograd
functions alike, on any device) and, once the forward returns, adds up the storages that are
still alive, at their size then (FSDP frees gathered weights by resizing their storage to 0):
exactly the memory kept for the backward, attributed to the block that created it.
`measure_host_state` adds up the host storages of the state parallel.offload_state moved.
`lctrain.planning.activations.activation_formula` is the closed form it is tested against.
`measure_peak(run_step, model)` follows the same storages through a forward and backward (or a
model's build) and reports the most alive at once.
"""

from __future__ import annotations

import itertools
import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lctrain.config import LctrainConfig
from lctrain.config.derived import load_balance_of, ulysses_degree
from lctrain.data.batch import micro_batch_from_tokens
from lctrain.models.decoder import without_routing
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.parallel.tensor import vocab_parallel

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


def holding_tensor(t):
    """The tensor holding the memory: a DTensor's local shard, an async collective's result."""
    t = getattr(t, "_local_tensor", t)
    return getattr(t, "elem", t)


class _Tracker(TorchDispatchMode):
    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude  # parameter storages: views of weights are not activations
        self.where = "other"
        self.created: list[list] = []  # [where, weakref to the tensor, op]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
            out = _call_collective(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        for t in map(holding_tensor, tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if storage.data_ptr() in self.exclude:
                    continue
                self.created.append([self.where, weakref.ref(t), func])
        return out

    def claim(self, where: str, tensor) -> None:
        """Attribute the storage of `tensor` (alive now) to `where`, whoever created it."""
        tensor = holding_tensor(tensor)
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return
        ptr = tensor.untyped_storage().data_ptr()
        for entry in self.created:
            t = entry[1]()
            if t is not None and t.untyped_storage().data_ptr() == ptr:
                entry[0] = where


class _PeakTracker(_Tracker):
    """Also the largest total of live storages after any op (forward and backward alike)."""

    def __init__(self, exclude: set[int]):
        super().__init__(exclude)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.created = [e for e in self.created if e[1]() is not None]
        live = {}
        for entry in self.created:
            storage = entry[1]().untyped_storage()
            live[storage.data_ptr()] = storage.nbytes()  # at its size now (FSDP resizes)
        self.peak = max(self.peak, sum(live.values()))
        return out


def measure_peak(run_step, model: nn.Module | None = None) -> int:
    """The most bytes alive at once during `run_step()` (e.g. a forward and its backward, or
    building a model) in storages that its ops created, `model`'s parameters left out:
    activations, gradients, gathered weights, the backward's temporaries. The memory
    allocator's caching and fragmentation are not included."""
    tracker = _PeakTracker(_parameter_storages(model) if model is not None else set())
    with tracker:
        run_step()
    return tracker.peak


def measure_activations(model: nn.Module, run_forward,
                        details: list | None = None) -> dict[str, int]:
    """Bytes alive after `run_forward()` (which must keep its output alive, e.g. return the loss)
    that ops created during it, per layer id ('other' for embedding, head and loss). `details`,
    when given, receives (where, op, dtype, shape, bytes) for every storage counted.

    A block's input counts as the block's (with full checkpointing it is all a block keeps),
    whoever created it, and the last block's output as 'other' (the final norm's input): every
    block then counts the same."""
    tracker = _Tracker(_parameter_storages(model))
    hooks = []

    def enter(name):
        def hook(module, args):
            tracker.where = name
            tracker.claim(name, args[0])
        return hook

    def leave(module, args, out):
        tracker.where = "other"
        tracker.claim("other", out)

    for name, layer in unwrap(model).layers.items():
        hooks.append(layer.register_forward_pre_hook(enter(name)))
        hooks.append(layer.register_forward_hook(leave))
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
    alive: dict[int, tuple] = {}
    for where, ref, op in tracker.created:
        t = ref()
        if t is None:
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in alive and ptr not in weights:
            alive[ptr] = (where, str(op), t.dtype, tuple(t.shape), storage.nbytes())
    del keep
    per_layer: dict[str, int] = defaultdict(int)
    for row in alive.values():
        per_layer[row[0]] += row[-1]
    if details is not None:
        details.extend(alive.values())
    return dict(per_layer)


def _parameter_storages(model: nn.Module) -> set[int]:
    """Data pointers of the storages the model's parameters and buffers use now (local shards
    of DTensors, FSDP's gathered weights while they are registered)."""
    return {holding_tensor(p).untyped_storage().data_ptr()
            for p in itertools.chain(model.parameters(), model.buffers())}


def build_measured_model(cfg: LctrainConfig, batch: int, seed: int = 0):
    """(model, run_forward) on the layout of `cfg`, the model built as training builds it (call
    on every rank of an initialised world); run_forward() runs one training forward on a fixed
    batch and returns the loss."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(1, cfg.model.vocab_size, (batch, cfg.train.seq_len + 1), generator=gen)
    p = cfg.parallel
    mb = micro_batch_from_tokens(x, cfg.train.seq_len, rt.axis_rank("cp"), p.cp,
                                 load_balance_of(cfg), document_masking=cfg.data.document_masking,
                                 ulysses=ulysses_degree(p)).to(rt.device)  # as the loop moves it (doc ids stay on host)

    def run_forward():  # as training runs it: the loss, bf16 autocast, offload
        with vocab_parallel(rt.topology.tp), rt.autocast(), rt.saved_activations():
            return without_routing(model(mb.inputs, positions=mb.positions, doc_ids=mb.doc_ids,
                                         labels=mb.labels))

    return model, run_forward


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """AdamW's state tensors (its moments; the step counts left out)."""
    return [v for state in optimizer.state.values() for k, v in state.items()
            if k != "step" and isinstance(v, torch.Tensor)]


def host_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer,
                       offload_state: str) -> list[torch.Tensor]:
    """What parallel.offload_state keeps in host memory: AdamW's moments, and FSDP's shards and
    gradients (optimizer+params) or HostAdamW's weight and gradient buffers (optimizer)."""
    if offload_state == "none":
        return []
    tensors = optimizer_state_tensors(optimizer)
    if offload_state == "optimizer":
        return tensors + [t for pair in optimizer.buffers.values() for t in pair]
    return tensors + list(model.parameters()) + [p.grad for p in model.parameters()]


def measure_host_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                       offload_state: str) -> tuple[int, int]:
    """(bytes, pinned bytes) of the distinct host storages the state offloaded under
    parallel.offload_state holds (0 for none): AdamW's moments, and FSDP's shards and
    gradients (optimizer+params) or HostAdamW's weight and gradient buffers (optimizer).
    `lctrain.planning.state.host_state_parts` is the closed form it is tested against."""
    tensors = host_state_tensors(model, optimizer, offload_state)
    storages = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        if local is not None and local.device.type == "cpu":
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), local.is_pinned())
    return (sum(n for n, _ in storages.values()),
            sum(n for n, pinned in storages.values() if pinned))
