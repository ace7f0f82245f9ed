"""Activation memory measured: what a forward pass leaves alive for the backward, per layer, on
a model laid out exactly as training lays it out.

`measure_activations(model, run_forward)` follows every storage that an op creates during the
forward (`lctrain.tracing.live.LiveBytes`, the tracker the trace uses) and, once the forward
returns, adds up the ones still alive, at their size then (FSDP frees gathered weights by
resizing their storage to 0): exactly the memory kept for the backward, attributed to the block
that created it.
`measure_host_state` adds up the host storages of the state parallel.offload_state moved.
`lctrain.planning.activations.activation_formula` is the closed form it is tested against.
`measure_peak(run_step, model)` follows the same storages through a forward and backward (or a
model's build) and reports the most alive at once.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from lctrain.config import LctrainConfig
from lctrain.config.derived import load_balance_of, ulysses_degree
from lctrain.data.batch import micro_batch_from_tokens
from lctrain.models.decoder import without_routing
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.parallel.tensor import vocab_parallel
from lctrain.tracing.live import LiveBytes, storage_of


def measure_peak(run_step, model: nn.Module | None = None) -> int:
    """The most bytes alive at once during `run_step()` (e.g. a forward and its backward, or
    building a model) in storages that its ops created, `model`'s parameters left out:
    activations, gradients, gathered weights, the backward's temporaries. The memory
    allocator's caching and fragmentation are not included."""
    tracker = LiveBytes(exclude=_parameter_storages(model) if model is not None else set(),
                        views=True)
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
    tracker = LiveBytes(exclude=_parameter_storages(model), views=True)
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
    tracker.settle()
    # Read now, not when created: FSDP frees a block's gathered weights after its forward (size
    # 0) and keeps the root's gathered weights as the module's parameters until the backward:
    # weights, not activations.
    alive = tracker.alive(leave_out=_parameter_storages(model))
    del keep
    if details is not None:
        details.extend(alive)
    per_layer: dict[str, int] = {}
    for row in alive:
        per_layer[row[0]] = per_layer.get(row[0], 0) + row[-1]
    return per_layer


def _parameter_storages(model: nn.Module) -> set[int]:
    """Ids of the storages the model's parameters and buffers use now (local shards of DTensors,
    FSDP's gathered weights while they are registered)."""
    return {id(storage_of(p)) for p in itertools.chain(model.parameters(), model.buffers())}


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
