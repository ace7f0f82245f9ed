"""The training loop, read top to bottom: train() builds everything in data-flow order and runs
the steps; train_step() is one optimizer step; forward_backward() is one micro-batch. It runs on
every rank (`lctrain.commands.train` starts the ranks).

Loss (docs/parallelism.md §10; `_token_weighted_loss`, shared by every data-parallel engine):
the sum of token losses over valid targets, divided by the number of valid targets summed over
dp x cp and over the accumulation micro-steps of the step (token-weighted, never a mean of
per-rank means). Gradient reduction averages over dp x cp, so the backward loss is scaled by
that group size to make the reduced gradient the exact gradient of the global token mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from lctrain import device
from lctrain.comm import record_traffic
from lctrain.config import LctrainConfig, ModelConfig
from lctrain.config.derived import Stage, context_stages, load_balance_of, stage_banner
from lctrain.config.model_size import param_count
from lctrain.config.resolved import as_dict, to_yaml
from lctrain.data.batch import MicroBatch
from lctrain.data.loader import DataLoader, build_loader
from lctrain.layout.stages import split_layers
from lctrain.models.hf import export_hf, full_parameters
from lctrain.models.moe import EP_TAG
from lctrain.parallel import deepspeed_engine
from lctrain.parallel.data_parallel import (
    data_parallel_engine,
    gradient_sync,
    reduce_expert_grads,
    unwrap,
)
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.pipeline import PipelinedModel
from lctrain.parallel.runtime import Runtime, setup_distributed
from lctrain.parallel.tensor import loss_value, plus_aux, vocab_parallel
from lctrain.rundir import RunDir
from lctrain.rundir.checkpoints import complete_checkpoints
from lctrain.rundir.files import write_atomic
from lctrain.training import progress
from lctrain.training.checkpoint import Checkpointer, TrainState
from lctrain.training.evals import Evaluator, format_table
from lctrain.training.metrics import MetricsLogger, StepMeter
from lctrain.training.optim import build_optimizer, build_scheduler, clip_grad_norm_
from lctrain.training.preemption import PreemptionWatcher


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm with train.on_nan=stop."""


def forward_backward(model: nn.Module, mb: MicroBatch, loss_scale: Tensor | float,
                     rt: Runtime, routing: Routing | None = None) -> Tensor:
    """Backward of (sum of this rank's token losses) * loss_scale, plus a mixture of experts'
    load-balancing loss at its weight (`aux_weight`); returns the detached sum. `routing`
    accumulates the micro-step's routing statistics (MoE models)."""
    mb = mb.to(rt.device)
    with vocab_parallel(rt.topology.tp):
        with rt.autocast(), rt.saved_activations():
            loss_sum = model(mb.inputs, mb.positions, mb.doc_ids, labels=mb.labels)
        objective = loss_sum * loss_scale
        core = unwrap(model)
        aux = getattr(core, "aux_loss", None)
        if aux is not None:
            objective = plus_aux(objective, aux_weight(core.cfg, rt) * aux)
            if routing is not None:
                routing.add(aux.detach(), core.expert_counts)
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


def _micro_steps(model: nn.Module, micro_batches: list[MicroBatch], loss_scale: Tensor | float,
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


def _token_weighted_loss(micro_batches: list[MicroBatch], rt: Runtime,
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
        loss, tokens = _token_weighted_loss(
            micro_batches, rt,
            lambda loss_scale: _micro_steps(model, micro_batches, loss_scale, rt, routing))
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
    loss, tokens = _token_weighted_loss(
        micro_batches, rt,
        lambda loss_scale: deepspeed_engine.micro_steps(engine, micro_batches, loss_scale, rt))
    lr = scheduler.get_last_lr()[0]
    applied = engine.was_step_applied()
    if applied:
        scheduler.step()
    read = read_all({"loss": loss, "valid_tokens": tokens})
    read["grad_norm"] = deepspeed_engine.grad_norm(engine)
    return _step_metrics(read, lr, applied and math.isfinite(read["loss"]))


def _launched_by_torchrun(rt: Runtime) -> bool:
    """Ranks torchrun or srun started (the local launcher watches its ranks itself)."""
    return rt.world_size > 1 and os.environ.get("LCTRAIN_LAUNCHER") != "local"


def _agree_run_dir(run_dir: Path, rt: Runtime) -> Path:
    """Rank 0's run dir: ranks started on different nodes may have resolved ${now:} differently."""
    if rt.world_size == 1:
        return run_dir
    box = [str(run_dir)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _timed_step(model, optimizer, scheduler, loader: DataLoader, cfg: LctrainConfig,
                rt: Runtime) -> dict:
    """One step with its timings and the context- and expert-parallel traffic it sent."""
    t0 = time.perf_counter()
    micro_batches = loader.next_step()
    data_time = time.perf_counter() - t0
    with record_traffic() as traffic:
        out = train_step(model, optimizer, scheduler, micro_batches, cfg, rt)
    elapsed = time.perf_counter() - t0
    sent = {tag: 0 for tag in ("cp", EP_TAG)}  # the experts' all-to-all apart
    for (tag, _), nbytes in traffic.bytes.items():
        sent[EP_TAG if tag == EP_TAG else "cp"] += nbytes
    out.update(step_time=elapsed, data_time=data_time,
               tokens_per_sec=rt.derived.tokens_per_step / elapsed,
               cp_bytes_sent=sent["cp"], ep_bytes_sent=sent[EP_TAG])
    return out


def _check_finite(out: dict, step: int, cfg: LctrainConfig, metrics: MetricsLogger) -> None:
    if not out["skipped"]:
        return
    if cfg.train.on_nan == "stop":
        raise NonFiniteError(
            f"step {step}: loss {out['loss']}, grad norm {out['grad_norm']}; the update was not "
            "applied (train.on_nan=stop). Resume from the last checkpoint with a lower optim.lr, "
            "check the data, or set train.on_nan=skip")
    metrics.info(f"lctrain: warning: step {step} skipped: loss {out['loss']}, grad norm "
                 f"{out['grad_norm']} (train.on_nan=skip)")


def train(cfg: LctrainConfig, run_dir: str | os.PathLike) -> list[dict]:
    """Train on this rank; returns the metrics of every step run (identical on all ranks).

    With train.stages the stages run one after the other (`_train_stage`), each built for its
    own sequence length and started from the checkpoint the stage before ended with (its data
    continuing at the same token); a resumed run skips the stages its newest checkpoint has
    finished. Without stages, the one stage is the run."""
    history: list[dict] = []
    stages = context_stages(cfg)
    for stage in stages:
        if stage.index > 0:  # from the run's own checkpoints, whatever checkpoint.* says
            stage = dataclasses.replace(stage, cfg=dataclasses.replace(
                stage.cfg, checkpoint=dataclasses.replace(stage.cfg.checkpoint, load=None,
                                                          resume="auto")))
        if len(stages) > 1 and _newest_step(stage.cfg, Path(run_dir)) >= stage.last:
            continue  # finished before this run started
        ran, stopped = _train_stage(cfg, stage, run_dir, final=stage is stages[-1])
        history += ran
        if stopped:
            break
    return history


def _newest_step(cfg: LctrainConfig, run_dir: Path) -> int:
    """The step of the newest complete checkpoint this stage would resume from (0: none)."""
    c = cfg.checkpoint
    if c.load is not None or c.resume != "auto":
        return 0
    found = complete_checkpoints(RunDir(run_dir).checkpoints(c.dir))
    return int(found[0].name.split("-")[1]) if found else 0


def _train_stage(full: LctrainConfig, stage: Stage, run_dir: str | os.PathLike,
                 final: bool) -> tuple[list[dict], bool]:
    """Steps stage.first..stage.last of the run `full` (with stage.cfg's sequence length and
    batch); returns the metrics of the steps run and whether a stop ended it early.

    Setup builds every part inside the `try`, so a part that fails to build still closes those
    built before it (`_Closing`); the step loop runs to the stage's last step or to a stop, a
    stage before the last ending with a checkpoint; teardown waits for the last checkpoint and,
    after the run's last step, exports the weights."""
    cfg = stage.cfg
    rt = setup_distributed(cfg)
    run_dir = _agree_run_dir(Path(run_dir), rt)
    closing, history = _Closing(), []
    stopped = False
    try:
        # ---- setup, in data-flow order
        closing.watcher = watcher = PreemptionWatcher(RunDir(run_dir).stop, rt.rank)
        closing.record = _progress_record(cfg, rt, run_dir)
        _write_config(full, rt, run_dir)
        model, optimizer, scheduler, loader = build_training(cfg, rt)
        closing.metrics = metrics = MetricsLogger(cfg.logging, run_dir, rt.rank, cfg.train.steps,
                                                  as_dict(cfg))
        _log_layout(metrics, cfg, rt, model, loader)
        meter = StepMeter(cfg, rt, metrics.info)  # on the CPU: times a matmul on every rank
        closing.checkpointer = checkpointer = Checkpointer(cfg, rt, run_dir, to_yaml(cfg),
                                                           metrics.info)
        evaluator = Evaluator(cfg, rt)
        checkpointer.continue_data = stage.index > 0
        for line in stage_banner(full, stage):
            metrics.info(line)
        state = checkpointer.maybe_resume(model, optimizer, scheduler, loader)
        metrics.start(state.step)  # metrics.jsonl keeps each step once
        meter.start()
        # ---- the step loop
        for step in range(state.step + 1, stage.last + 1):
            progress.mark(step=step, micro_step=0, phase="train")
            out = _timed_step(model, optimizer, scheduler, loader, cfg, rt)
            meter.per_step(out)
            _check_finite(out, step, cfg, metrics)
            state.step, state.tokens = step, state.tokens + rt.derived.tokens_per_step
            out.update(step=step, tokens=state.tokens)
            evaluated = _maybe_evaluate(evaluator, step, model, out, cfg, metrics)
            stop = watcher.requested(rt)
            boundary = step == stage.last and not final  # the next stage starts from it
            if checkpointer.should_save(step) or stop or boundary:
                out["checkpoint_stall"] = _save(checkpointer, step, model, optimizer, loader,
                                                state, wait=stop or boundary)
            history.append(out)
            if metrics.should_log(step) or evaluated or stop:  # the same steps on every rank
                meter.reduce(out)  # collective: peak memory and data time over the ranks
                metrics.log(step, {k: v for k, v in out.items() if k != "step"})
            if stop:
                progress.mark(stopped_because=watcher.reason)
                metrics.info(f"lctrain: stopping after step {step} ({watcher.reason}); the "
                             "checkpoint is saved; resume it with: "
                             f"{RunDir(run_dir).resume_command()}")
                stopped = True
                break
        # ---- teardown
        checkpointer.wait()
        closing.outcome = "done" if state.step == stage.last else "stopped"
        if closing.outcome == "done" and final:
            _complete(cfg, rt, model, watcher, metrics)
    finally:
        closing.close()
    return history, stopped


class _Closing:
    """The parts of a run that hold something to give back, set by train() as it builds them
    (None until then), and closed by `close` whatever happened: the checkpointer first (its
    background save commits or fails), then the signal handlers, then the progress record with
    `outcome` as its last phase (its stall watch ends before wandb's upload), the metrics
    logger last."""

    def __init__(self):
        self.checkpointer: Checkpointer | None = None
        self.watcher: PreemptionWatcher | None = None
        self.record: progress.ProgressRecord | None = None
        self.metrics: MetricsLogger | None = None
        self.outcome = "failed"

    def close(self) -> None:
        """Close every part built, in the order above; one that fails to close does not keep
        the others open (its error is raised once all are closed)."""
        with contextlib.ExitStack() as stack:  # runs its callbacks last-pushed first
            if self.metrics is not None:
                stack.callback(self.metrics.close)
            if self.record is not None:
                stack.callback(lambda: self.record.close(self.outcome))
            if self.watcher is not None:
                stack.callback(self.watcher.restore)
            if self.checkpointer is not None:
                stack.callback(self.checkpointer.close)


def _progress_record(cfg: LctrainConfig, rt: Runtime, run_dir: Path) -> progress.ProgressRecord:
    """This rank's progress record; rank 0 under torchrun or srun also watches for a stall."""
    return progress.ProgressRecord(
        run_dir, rt.rank, rt.world_size, progress.named_groups(rt.mesh.meshes if rt.mesh else None),
        stall_s=cfg.launch.stall_s if rt.rank == 0 and _launched_by_torchrun(rt) else 0)


def _write_config(cfg: LctrainConfig, rt: Runtime, run_dir: Path) -> None:
    if rt.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(RunDir(run_dir).config, to_yaml(cfg))  # a failed write keeps the old


def build_training(cfg: LctrainConfig, rt: Runtime) -> tuple[nn.Module, torch.optim.AdamW,
                                                             LambdaLR, DataLoader]:
    """The model (under its data-parallel engine), AdamW, the lr schedule and the data loader."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, rt)
    optimizer = build_optimizer(model, cfg.optim,
                                on_host=cfg.parallel.offload_state == "optimizer")
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    if data_parallel_engine(cfg, rt) == "deepspeed":
        model = deepspeed_engine.initialize(model, optimizer, cfg, rt)
    loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
    return model, optimizer, scheduler, loader


def _log_layout(metrics: MetricsLogger, cfg: LctrainConfig, rt: Runtime, model: nn.Module,
                loader: DataLoader) -> None:
    metrics.info(f"lctrain: {rt.world_size} rank(s) on {rt.device.type}, layout "
                 f"{rt.topology.shape} (pp, dp, cp_ring, cp_ulysses, tp), grad_accum "
                 f"{rt.derived.grad_accum}, {param_count(cfg.model):,} parameters")
    for line in run_lines(cfg):
        metrics.info(f"lctrain: {line}")
    if isinstance(model, PipelinedModel):
        metrics.info(f"lctrain: pipeline {cfg.parallel.pp_schedule}, layers per stage "
                     f"{[len(s) for s in split_layers(cfg)]}, {rt.derived.grad_accum} "
                     f"micro-batches per step")
    for line in loader.source.report() if hasattr(loader.source, "report") else []:
        metrics.info(f"lctrain: {line}")
    if loader.dropped:
        metrics.info(f"lctrain: data.long_docs=drop skips {loader.dropped:,} documents longer "
                     f"than train.seq_len={cfg.train.seq_len}")


def run_lines(cfg: LctrainConfig) -> list[str]:
    """What the start of a run says beside the layout: the model and its family, how attention
    is split (the CP algorithm and load balance), the data-parallel engine and dtype; for a
    mixture of experts, its routing and whether the load-balancing loss is added."""
    m, p = cfg.model, cfg.parallel
    cp = (f"{p.attention} attention over cp={p.cp}, load balance {load_balance_of(cfg)}"
          if p.cp > 1 else "attention on each rank's whole sequence (cp=1)")
    lines = [f"model {m.name} (family {m.family}), {cp}, {p.dp_engine} over dp x cp, "
             f"{cfg.train.dtype}"]
    if m.n_experts:
        aux = (f"the load-balancing loss is added at model.router_aux_loss_coef="
               f"{m.router_aux_loss_coef}" if m.router_aux_loss_coef else
               "no load-balancing loss (model.router_aux_loss_coef=0; aux_loss is logged only)")
        lines.append(f"mixture of experts: {m.n_experts} experts, {m.experts_per_token} per "
                     f"token, ep={p.ep}; {aux}")
    return lines


def _maybe_evaluate(evaluator: Evaluator, step: int, model: nn.Module, out: dict,
                    cfg: LctrainConfig, metrics: MetricsLogger) -> bool:
    """Evaluate after `step` if it is an eval step (the same steps on every rank): the results
    go into the step's metrics `out` and the log. Returns whether it evaluated."""
    if not evaluator.should_run(step):
        return False
    progress.mark(phase="eval")
    results = evaluator.run(model)
    out.update(results)
    for line in format_table(results, cfg.eval.tasks):
        metrics.info(line)
    return True


def _complete(cfg: LctrainConfig, rt: Runtime, model: nn.Module, watcher: PreemptionWatcher,
              metrics: MetricsLogger) -> None:
    """After the last step: nothing to requeue; the Hugging Face export, if asked for."""
    watcher.completed()
    if cfg.checkpoint.export_hf is None:
        return
    parameters = (model.full_parameters() if isinstance(model, PipelinedModel)
                  else full_parameters(unwrap(model)))
    export_hf(parameters, cfg.model, cfg.checkpoint.export_hf, rt.rank)
    metrics.info(f"lctrain: exported Hugging Face weights to {cfg.checkpoint.export_hf}")


def _save(checkpointer: Checkpointer, step: int, model, optimizer, loader, state: TrainState,
          wait: bool) -> float:
    """Checkpoint after `step`; returns the seconds training stood still for it."""
    t0 = time.perf_counter()
    progress.mark(phase="checkpoint")
    checkpointer.save(step, model, optimizer, loader, state, wait=wait)
    return time.perf_counter() - t0
