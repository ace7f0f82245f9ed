"""Pipeline parallelism: this rank's stages of the model, the schedule that trains them
(torch.distributed.pipelining), and a plain forward through every stage for evals.

The model is cut into parallel.pp x pp_virtual_stages stages (lctrain.layout.stages). A stage is
a model that holds only its layers, under their global ids, with the embedding on the first stage
and the final norm, output layer and loss on the last, so checkpoint keys never depend on pp.
Each stage is laid out as a whole model would be (TP + SP, tiling, checkpointing, then FSDP or
DDP over the dp x cp group of its pipeline coordinate). Every rank of a pipeline reads the same
micro-batches; the first stage takes the tokens, every stage takes the RoPE positions and the
document ids as keywords, and the last stage takes the labels and returns the sum of its token
losses, scaled for the backward exactly as without pipelining (docs/parallelism.md §10, §13).

A tied output layer (model.tie_embeddings) lives on two stages: the first stage's embedding is
the weight, and the last stage's output layer a copy of it that the optimizer never sees. After
the backward the copy's gradient is added to the embedding's; after every update, and whenever
weights are loaded, the copy is refreshed from the embedding (docs/parallelism.md §27).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from lctrain import device
from lctrain.config import LctrainConfig
from lctrain.config.derived import dtype_bytes
from lctrain.data.batch import MicroBatch
from lctrain.layout.stages import rank_of, split_layers, stage_count, stages_of
from lctrain.models.blocks import AttentionCore
from lctrain.models.decoder import Decoder, without_routing
from lctrain.models.gated_deltanet import LOCAL_LINEAR, LinearCore
from lctrain.models.moe import table_counts
from lctrain.models.registry import new_model
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.experts import routing_loss
from lctrain.parallel.runtime import Runtime
from lctrain.parallel.tensor import (
    laid_out_as,
    local_part,
    loss_value,
    plus_aux,
    vocab_parallel,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}


def my_stages(cfg: LctrainConfig, rt: Runtime) -> list[int]:
    """The stage ids this rank runs, in order."""
    return stages_of(cfg, rt.axis_rank("pp"))


def stage_model(cfg: LctrainConfig, core: AttentionCore, stage: int,
                linear: LinearCore = LOCAL_LINEAR) -> Decoder:
    """Stage `stage` of the model on the meta device: its layers under their global ids, the
    embedding if it is the first stage, the final norm and output layer if it is the last. A
    stage of a mixture of experts takes the routing table of the stages before it beside the
    hidden state and returns it with its own layers' added (`Decoder.forward`)."""
    layers = set(split_layers(cfg)[stage])
    with torch.device("meta"):
        model = new_model(cfg.model, core, linear)
    for key in [k for k in model.layers if int(k) not in layers]:
        del model.layers[key]
    if stage > 0:
        model.tok_embeddings = None
    if stage < stage_count(cfg) - 1:
        model.norm = model.output = None
    return model


def stage_io(cfg: LctrainConfig, rt: Runtime, stage: int) -> dict:
    """What stage `stage` receives and sends per micro-batch, as torch's PipelineStage takes it
    (input_args, output_args and their gradients, on the meta device), for a trace: on its first step the schedule
    otherwise learns them from the neighbouring ranks by object collectives, which a trace's
    fake process group cannot carry. The hidden state [B, S/(cp*s), D] (s = tp with SP) in the
    residual dtype (bf16 when FSDP computes in bf16: the embedding's output), token ids into
    the first stage, and beside the hidden state a mixture of experts' routing table
    [M + 2, E] (`lctrain.models.moe.RouterLog.table`); the last stage returns the loss sum (and
    the table)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    s = p.tp if (p.sp and p.tp > 1) else 1
    residual = dtype_bytes(cfg, rt.world_size)[1]
    rows, local = t.micro_batch, t.seq_len // p.cp
    meta = torch.device("meta")
    # what travels between stages carries a gradient back: torch makes the receive buffers
    # of a given shape require one only if the example does
    hidden = torch.empty(rows, local // s, m.dim, device=meta, requires_grad=True,
                         dtype=torch.bfloat16 if residual == 2 else torch.float32)
    totals = ((torch.empty(len(m.moe_layer_ids) + 2, m.n_experts, device=meta, requires_grad=True),)
              if m.n_experts else ())
    inputs = ((torch.empty(rows, local, dtype=torch.long, device=meta),) if stage == 0
              else (hidden, *totals))
    last = stage == stage_count(cfg) - 1
    outputs = ((torch.empty((), device=meta), *totals) if last else (hidden, *totals))
    return {"input_args": inputs, "output_args": outputs,  # and their gradients, alike
            "input_grads": (None,) if stage == 0 else inputs,
            "output_grads": None if last else outputs}


def _static_shapes(stages: list[PipelineStage], *_) -> None:
    """A trace's stand-in for the schedule's first-step vote: every stage's shapes are given."""
    from torch.distributed.pipelining.stage import InferenceMode  # torch >= 2.12, traces only

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


class PipelinedModel(nn.Module):
    """This rank's stages as one module under the global parameter names (layers.{i}.*,
    tok_embeddings.*, norm.*, output.*), so that the optimizer, gradient clipping, checkpoints
    and export see the same names as without pipelining; `train_step` runs the schedule and
    `forward` runs the stages one after the other (no backward: evals, validation)."""

    def __init__(self, parts: dict[int, nn.Module], cfg: LctrainConfig, rt: Runtime):
        """parts: stage id -> the stage laid out for training (FSDP- or DDP-wrapped)."""
        super().__init__()
        self.cfg, self.rt = cfg, rt
        self.n_stages = stage_count(cfg)
        self.layers = nn.ModuleDict()
        self.tok_embeddings = self.norm = self.output = None
        self.tied = cfg.model.tie_embeddings
        roots = ("tok_embeddings", "norm") if self.tied else ("tok_embeddings", "norm", "output")
        for stage in sorted(parts):
            model = unwrap(parts[stage])
            for key, layer in model.layers.items():
                self.layers[key] = layer
            for name in roots:
                if getattr(model, name) is not None:
                    setattr(self, name, getattr(model, name))
        self.parts = parts  # a plain dict: the stage modules are reached through the names above
        for part in parts.values():
            if isinstance(part, nn.parallel.DistributedDataParallel):
                # the schedule arms DDP's gradient hooks itself, before each stage's last
                # backward of a step; armed by every forward too, the first step would record
                # each parameter once per micro-batch and DDP's bucket rebuild would fail
                part.require_backward_grad_sync = False
        p = cfg.parallel
        pp_group = rt.group("pp")
        self.stages = [PipelineStage(parts[s], s, self.n_stages, rt.device, group=pp_group,
                                     **(stage_io(cfg, rt, s) if device.current().traced else {}))
                       for s in sorted(parts, key=my_stages(cfg, rt).index)]
        schedule = SCHEDULES[p.pp_schedule]
        kwargs = dict(n_microbatches=rt.derived.grad_accum, loss_fn=self._scaled_loss,
                      scale_grads=False)
        self.schedule = (schedule(self.stages, **kwargs) if issubclass(
            schedule, PipelineScheduleMulti) else schedule(self.stages[0], **kwargs))
        if device.current().traced and hasattr(self.schedule, "_warmup_p2p"):
            # every stage has its shapes (stage_io); the neighbours' vote on that (torch >= 2.12)
            # cannot cross a trace's fake process group
            self.schedule._warmup_p2p = _static_shapes
        self._loss_scale, self._aux_weight = 1.0, 0.0
        self._loss_sums: list[Tensor] = []
        self._aux_values: list[Tensor] = []
        self._routing_counts: list[Tensor] = []
        # every load_state_dict (resume, checkpoint.load, load_model_only) ends by refreshing
        self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh_copy())
        self.refresh_copy()  # initialised or loaded as the embedding's, its values from there

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.parts

    @property
    def copy(self) -> Tensor | None:
        """The last stage's copy of the tied embedding, on its ranks: not among this module's
        parameters, so the optimizer, clipping and checkpoints see the embedding alone."""
        if not (self.tied and self.has_last_stage):
            return None
        return unwrap(self.parts[self.n_stages - 1]).output.weight

    def _scaled_loss(self, output: Tensor | tuple[Tensor, Tensor], _target: Tensor) -> Tensor:
        """The schedule's loss function: the last stage already returns the loss sum (with a
        mixture of experts' routing table beside it, every stage's layers in it: its
        load-balancing loss is added at its weight `aux_weight`)."""
        loss_sum, table = output if isinstance(output, tuple) else (output, None)
        self._loss_sums.append(loss_value(loss_sum.detach()))
        scaled = loss_sum * self._loss_scale
        if table is None:
            return scaled
        aux = routing_loss(table, self.cfg.model, self.rt)
        self._aux_values.append(aux.detach())
        self._routing_counts.append(table_counts(table))
        return plus_aux(scaled, self._aux_weight * aux)

    def train_step(self, micro_batches: list[MicroBatch], loss_scale: Tensor | float,
                   aux_weight: float = 0.0) -> Tensor:
        """Forward and backward of the step's micro-batches through the pipeline schedule; the
        detached sum of token losses (on the last stage; 0 on the others). `aux_weight`: a
        mixture of experts' load-balancing loss's weight (its values and the tokens per expert of
        every MoE layer, on the last stage's ranks: `routing`)."""
        rt = self.rt
        mbs = [mb.to(rt.device) for mb in micro_batches]
        inputs = torch.cat([mb.inputs for mb in mbs])
        kwargs = {"positions": torch.cat([mb.positions.expand_as(mb.inputs) for mb in mbs]),
                  "labels": torch.cat([mb.labels for mb in mbs])}
        if mbs[0].doc_ids is not None:
            kwargs["doc_ids"] = torch.cat([mb.doc_ids for mb in mbs])
        self._loss_scale, self._loss_sums = loss_scale, []
        self._aux_weight, self._aux_values, self._routing_counts = aux_weight, [], []
        args = (inputs,) if 0 in self.parts else ()
        # the loss is computed inside the last stage: the schedule's target is a placeholder
        target = torch.zeros(len(mbs), device=rt.device)
        with vocab_parallel(rt.topology.tp), rt.autocast(), rt.saved_activations():
            self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        total = torch.zeros((), device=rt.device, dtype=torch.float32)
        # the last ones: on its first step the schedule also runs a forward on placeholder
        # inputs to learn the shapes between stages
        for s in self._loss_sums[len(self._loss_sums) - len(mbs):]:
            total += s.float()
        self._add_copy_grad()
        return total

    @torch.no_grad()
    def refresh_copy(self) -> None:
        """The last stage's copy of a tied embedding <- the first stage's weight: after the model
        is built or loaded and after every optimizer step. Collective over the ranks of the first
        and the last stage (a no-op without a tied embedding)."""
        if not self.tied:
            return
        own = self.tok_embeddings.weight if self.tok_embeddings is not None else None
        arrived = self._between_ends(own, self.copy, to_last=True)
        if arrived is not None:
            local_part(self.copy).copy_(arrived)

    @torch.no_grad()
    def routing(self) -> tuple[list[Tensor], Tensor | None]:
        """The last step's load-balancing losses (one per micro-batch) and the tokens this rank's
        micro-batches sent to each expert of every MoE layer ([MoE layers, E]), on the last
        stage's ranks (zeros elsewhere: a sum over the pipeline counts each once), or None for
        a dense model. (On its first step the schedule also runs a forward on placeholder
        inputs to learn the shapes: the last forwards of the step are its micro-batches'.)"""
        m, accum = self.cfg.model, self.rt.derived.grad_accum
        if not m.n_experts:
            return self._aux_values[-accum:], None
        counts = torch.zeros(len(m.moe_layer_ids), m.n_experts, device=self.rt.device)
        for held in self._routing_counts[-accum:]:
            counts += held
        return self._aux_values[-accum:], counts

    def _add_copy_grad(self) -> None:
        """The embedding's gradient += the copy's (the tied weight's two uses, each reduced over
        dp x cp by its own stage); the copy's gradient is dropped."""
        if not self.tied:
            return
        mine = laid_out_as(self.copy.grad, self.copy) if self.copy is not None else None
        own = self.tok_embeddings.weight if self.tok_embeddings is not None else None
        arrived = self._between_ends(mine, own, to_last=False)
        if arrived is not None:
            own.grad = laid_out_as(own.grad, own)
            local_part(own.grad).add_(arrived)
        if self.copy is not None:
            self.copy.grad = None

    def _between_ends(self, source: Tensor | None, target: Tensor | None,
                      to_last: bool) -> Tensor | None:
        """The local part of `source` (a weight or gradient of one end stage, laid out like its
        parameter) as it arrives at the other end stage's rank, whose `target` parameter has the
        same local shape (the embedding and the output layer shard the [V, D] weight alike);
        None on every other rank."""
        first, last = self._peer(0), self._peer(self.n_stages - 1)
        sender, receiver = (first, last) if to_last else (last, first)
        rank = self.rt.rank
        if rank == sender:
            local = local_part(source)
            if sender == receiver:  # zbv: the first and the last stage share a rank
                return local
            dist.send(local.contiguous(), receiver)
        elif rank == receiver:
            local = local_part(target)
            buffer = torch.empty(local.shape, dtype=local.dtype, device=local.device)
            dist.recv(buffer, sender)
            return buffer
        return None

    @torch.no_grad()
    def forward(self, x: Tensor, positions: Tensor, doc_ids: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor | None:
        """The whole model's output (logits, or the loss sum with `labels`) on the rank of the
        last stage, None on the others: each stage receives its input from the rank of the stage
        before it. Collective over the pipeline: every pipeline rank calls it with the same
        batch."""
        positions = positions.expand(x.shape[0], positions.shape[-1])
        h: Tensor | None = x
        for stage in range(self.n_stages):
            if stage not in self.parts:
                continue
            if stage > 0 and stage - 1 not in self.parts:
                h = self._recv(self._peer(stage - 1))
            last = stage == self.n_stages - 1
            h = without_routing(self.parts[stage](h, positions=positions, doc_ids=doc_ids,
                                                  labels=labels if last else None))
            if not last and stage + 1 not in self.parts:
                self._send(h, self._peer(stage + 1))
        return h if self.has_last_stage else None

    @torch.no_grad()
    def full_parameters(self) -> Iterator[tuple[str, Tensor | None]]:
        """(name, whole fp32 tensor) of every parameter, in the unsplit model's order, on global
        rank 0 (None elsewhere). The ranks of the owning stage gather it over their own meshes,
        and the owner in rank 0's pipeline sends it to rank 0. Collective: iterate on every
        rank."""
        rt, topo = self.rt, self.rt.topology
        owner_of = _owners(self.cfg)
        root_line = all(c == 0 for axis, c in topo.coords(rt.rank).items() if axis != "pp")
        with torch.device("meta"):
            reference = new_model(self.cfg.model)
        for name, meta in reference.named_parameters():
            stage = owner_of(name)
            full = None
            if stage in self.parts:
                param = self.get_parameter(name)
                full = param.full_tensor() if isinstance(param, DTensor) else param
                full = full.float().contiguous()
            peer = self._peer(stage)
            if root_line and peer != 0:
                if rt.rank == peer:
                    dist.send(full, 0)
                elif rt.rank == 0:
                    full = torch.empty(meta.shape, dtype=torch.float32, device=rt.device)
                    dist.recv(full, peer)
            yield name, full if rt.rank == 0 else None

    def _peer(self, stage: int) -> int:
        """Global rank that runs `stage` in this rank's pipeline."""
        topo = self.rt.topology
        coords = topo.coords(self.rt.rank)
        coords["pp"] = rank_of(self.cfg, stage)
        return topo.rank(**coords)

    def _send(self, h: Tensor, peer: int) -> None:
        header = torch.tensor([_DTYPES.index(h.dtype), *h.shape], dtype=torch.int64,
                              device=h.device)
        dist.send(torch.tensor([header.numel()], device=h.device), peer)
        dist.send(header, peer)
        dist.send(h.contiguous(), peer)

    def _recv(self, peer: int) -> Tensor:
        device = self.rt.device
        size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(size, peer)
        header = torch.zeros(int(size), dtype=torch.int64, device=device)
        dist.recv(header, peer)
        out = torch.empty(header[1:].tolist(), dtype=_DTYPES[int(header[0])], device=device)
        dist.recv(out, peer)
        return out


def _owners(cfg: LctrainConfig) -> Callable[[str], int]:
    """parameter name -> the stage that holds it."""
    stage_of_layer = {layer: s for s, layers in enumerate(split_layers(cfg)) for layer in layers}
    last = stage_count(cfg) - 1

    def owner(name: str) -> int:
        if name.startswith("layers."):
            return stage_of_layer[int(name.split(".")[1])]
        return 0 if name.startswith("tok_embeddings.") else last

    return owner


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
"""Dtypes a hidden state can travel in between stages (index sent in the header)."""
