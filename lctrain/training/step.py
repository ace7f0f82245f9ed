"""One optimizer step, read top to bottom: train_step() runs the accumulation micro-steps of
this rank (forward_backward() is one micro-batch; a pipeline runs its schedule), clips, reads
the step's values on the host once, and applies the update only when it is finite.

Loss (docs/parallelism.md §10; `token_weighted_loss`, shared by every data-parallel engine):
the sum of token losses over valid targets, divided by the number of valid targets summed over
dp x cp and over the accumulation micro-steps of the step (token-weighted, never a mean of
per-rank means). Gradient reduction averages over dp x cp, so the backward loss is scaled by
that group size to make the reduced gradient the exact gradient of the global token mean.
A mixture of experts adds its load-balancing loss (`aux_weight`) and reports its routing
(`Routing`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lctrain import device
from lctrain.config import LctrainConfig, ModelConfig
from lctrain.data.batch import MicroBatch
from lctrain.models.moe import table_counts
from lctrain.parallel import deepspeed_engine
from lctrain.parallel.data_parallel import gradient_sync, reduce_expert_grads, unwrap
from lctrain.parallel.experts import routing_loss
from lctrain.parallel.pipeline import PipelinedModel
from lctrain.parallel.runtime import Runtime
from lctrain.parallel.tensor import loss_value, plus_aux, vocab_parallel
from lctrain.training import progress
from lctrain.training.optim import clip_grad_norm_


def forward_backward(model: nn.Module, mb: MicroBatch, loss_scale: Tensor | float,
                     rt: Runtime, routing: Routing | None = None) -> Tensor:
    """Backward of (sum of this rank's token losses) * loss_scale, plus a mixture of experts'
    load-balancing loss at its weight (`aux_weight`); returns the detached sum. `routing`
    accumulates the micro-step's routing statistics (MoE models)."""
    mb = mb.to(rt.device)
    with vocab_parallel(rt.topology.tp):
        with rt.autocast(), rt.saved_activations():
            out = model(mb.inputs, positions=mb.positions, doc_ids=mb.doc_ids, labels=mb.labels)
        loss_sum, table = out if isinstance(out, tuple) else (out, None)
        objective = loss_sum * loss_scale
        if table is not None:  # a mixture of experts: its routing table beside the loss
            m = unwrap(model).cfg
            aux = routing_loss(table, m, rt)
            objective = plus_aux(objective, aux_weight(m, rt) * aux)
            if routing is not None:
                routing.add(aux.detach(), table_counts(table))
        objective.backward()
    return loss_value(loss_sum.detach())


def aux_weight(m: ModelConfig, rt: Runtime) -> float:
    """The load-balancing loss's weight in one micro-step's backward (docs/parallelism.md §28):
    model.router_aux_loss_coef x cp / accumulation steps. Every cp rank of a micro-batch adds the
    same loss and back-propagates its own tokens' part, the gradients are averaged over dp x cp,
    and the step's loss is the mean over its dp x accumulation micro-batches."""
    return m.router_aux_loss_coef * rt.topology.cp / rt.derived.grad_accum


@dataclasses.dataclass
class Routing:
    """A step's routing on this rank: the load-balancing losses of its micro-steps (each the
    micro-batch's, the same on its cp and tp ranks; under pipelining on the last stage's ranks
    only) and the tokens it sent to each expert of each MoE layer (under pipelining, of its
    stages' layers), summed."""

    aux_sum: Tensor | None = None
    counts: Tensor | None = None
    micro_steps: int = 0

    def add(self, aux: Tensor, counts: Tensor, micro_steps: int = 1) -> None:
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        self.counts = counts if self.counts is None else self.counts + counts
        self.micro_steps += micro_steps

    def reduced(self, rt: Runtime) -> dict[str, Tensor]:
        """On the device: aux_loss (the mean over the step's micro-batches), expert_load (tokens
        per expert over the step, per MoE layer) and its largest max/mean over the layers; {}
        without experts."""
        if self.counts is None:
            return {}
        aux = _all_reduce(self.aux_sum.float().reshape(1), rt)
        counts = _all_reduce(self.counts.clone(), rt)
        for axis in ("tp", "pp"):  # TP ranks (always with SP here) route their own tokens
            if rt.topology.group_size(axis) > 1:
                dist.all_reduce(counts, group=rt.group(axis))
                if axis == "pp":  # only the last stage's ranks hold the losses
                    dist.all_reduce(aux, group=rt.group(axis))
        aux = aux / (self.micro_steps * rt.topology.group_size("dp_cp"))
        imbalance = counts.max(dim=1).values / counts.mean(dim=1)
        return {"aux_loss": aux.reshape(()), "expert_load": counts,
                "expert_load_max_over_mean": imbalance.max()}


def read_all(tensors: dict[str, Tensor]) -> dict:
    """Every tensor's values read on the host at once (one wait for the device, however many):
    a number for a one-element tensor, nested lists (integers for an integer tensor) else."""
    if not tensors:
        return {}
    flat = device.values(torch.cat([t.detach().double().reshape(-1) for t in tensors.values()]))
    out, at = {}, 0
    for name, t in tensors.items():
        part, at = flat[at:at + t.numel()], at + t.numel()
        if t.numel() == 1 and t.dim() <= 1:
            out[name] = part[0]
        else:
            dtype = torch.float64 if t.is_floating_point() else torch.long
            out[name] = torch.tensor(part, dtype=torch.float64).to(dtype).reshape(t.shape).tolist()
    return out


def _all_reduce(x: Tensor, rt: Runtime) -> Tensor:
    if rt.dp_cp_group is not None:
        dist.all_reduce(x, group=rt.dp_cp_group)
    return x


def micro_steps(model: nn.Module, micro_batches: list[MicroBatch], loss_scale: Tensor | float,
                 rt: Runtime, routing: Routing | None = None) -> Tensor:
    """Forward and backward of every micro-batch; the sum of this rank's token losses (with
    pipeline parallelism, summed over the pipeline: only the last stage computes losses). The
    gradients are reduced over dp x cp when it returns."""
    loss_sum = _forward_backward_all(model, micro_batches, loss_scale, rt, routing)
    parts = model.parts.values() if isinstance(model, PipelinedModel) else [model]
    if any(isinstance(part, nn.parallel.DistributedDataParallel) for part in parts):
        reduce_expert_grads(model, rt)  # (FSDP reduces the experts with the rest)
    return loss_sum


def _forward_backward_all(model: nn.Module, micro_batches: list[MicroBatch],
                          loss_scale: Tensor | float,
                          rt: Runtime, routing: Routing | None) -> Tensor:
    if isinstance(model, PipelinedModel):
        loss_sum = model.train_step(micro_batches, loss_scale, aux_weight(model.cfg.model, rt))
        dist.all_reduce(loss_sum, group=rt.group("pp"))
        aux_values, counts = model.routing()
        if routing is not None and counts is not None:
            routing.add(sum(aux_values, torch.zeros((), device=rt.device)), counts,
                        len(micro_batches))
        return loss_sum
    loss_sum = torch.zeros((), device=rt.device, dtype=torch.float32)
    for i, mb in enumerate(micro_batches):
        progress.mark(micro_step=i)
        with gradient_sync(model, sync=rt.sync_every_micro_step or i == len(micro_batches) - 1):
            loss_sum += forward_backward(model, mb, loss_scale, rt, routing)
    return loss_sum


def token_weighted_loss(micro_batches: list[MicroBatch], rt: Runtime,
                         micro_steps: Callable[[float], Tensor]) -> tuple[Tensor, Tensor]:
    """Runs `micro_steps(loss_scale)` (forward and backward of every micro-batch, returning
    the sum of this rank's token losses) and returns (the global token-mean loss, the valid
    targets summed over dp x cp and the accumulation micro-steps). Gradient reduction averages
    over dp x cp, so the loss scale dp_cp / tokens makes the reduced gradient the exact gradient
    of that global mean (docs/parallelism.md §10)."""
    local_tokens = sum(mb.targets for mb in micro_batches)  # counted on the host
    # float64: exact token counts far beyond float32's 2^24
    tokens = _all_reduce(torch.tensor(float(local_tokens), dtype=torch.float64,
                                      device=rt.device), rt)
    # a device tensor: the micro-steps start without waiting for the count's all-reduce
    loss_sum = micro_steps((rt.topology.group_size("dp_cp") / tokens).float())
    return _all_reduce(loss_sum, rt) / tokens, tokens


def train_step(model: nn.Module, optimizer, scheduler, micro_batches: list[MicroBatch],
               cfg: LctrainConfig, rt: Runtime) -> dict:
    """One optimizer step over this rank's accumulation micro-batches."""
    if deepspeed_engine.is_engine(model):
        return _deepspeed_step(model, scheduler, micro_batches, rt)
    routing = Routing()
    with rt.reproducible():
        loss, tokens = token_weighted_loss(
            micro_batches, rt,
            lambda loss_scale: micro_steps(model, micro_batches, loss_scale, rt, routing))
        grad_norm = clip_grad_norm_(list(model.parameters()), cfg.optim.grad_clip,
                                    rt.group("pp") if rt.topology.pp > 1 else None)
        lr = scheduler.get_last_lr()[0]
        # one host read per step: the update's decision (global values, the same on every
        # rank, so every rank decides alike) and the step's metrics
        read = read_all({"loss": loss, "grad_norm": grad_norm, "valid_tokens": tokens,
                         **routing.reduced(rt)})
        finite = math.isfinite(read["loss"]) and math.isfinite(read["grad_norm"])
        if finite:  # a non-finite update would destroy the weights: never apply it
            optimizer.step()
            scheduler.step()
            if isinstance(model, PipelinedModel):  # the tied embedding's copy, if any
                model.refresh_copy()
        optimizer.zero_grad(set_to_none=True)
    return _step_metrics(read, lr, finite)


def _step_metrics(read: dict, lr: float, applied: bool) -> dict:
    return {**read, "lr": lr, "valid_tokens": int(read["valid_tokens"]),
            "skipped": int(not applied)}


def _deepspeed_step(engine: nn.Module, scheduler, micro_batches: list[MicroBatch],
                    rt: Runtime) -> dict:
    """train_step under the DeepSpeed engine: the same token-weighted loss (DeepSpeed averages
    gradients over dp x cp as FSDP does), its global clipping, and lctrain's lr schedule,
    advanced only when DeepSpeed applied the step (it skips a step with a non-finite gradient
    norm)."""
    loss, tokens = token_weighted_loss(
        micro_batches, rt,
        lambda loss_scale: deepspeed_engine.micro_steps(engine, micro_batches, loss_scale, rt))
    lr = scheduler.get_last_lr()[0]
    applied = engine.was_step_applied()
    if applied:
        scheduler.step()
    read = read_all({"loss": loss, "valid_tokens": tokens})
    read["grad_norm"] = deepspeed_engine.grad_norm(engine)
    return _step_metrics(read, lr, applied and math.isfinite(read["loss"]))
