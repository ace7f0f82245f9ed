"""The training loop, read top to bottom: train() builds everything in data-flow order and runs
the steps (`lctrain.training.step`: train_step() is one optimizer step, forward_backward() one
micro-batch), with checkpoints, evals, metrics and the stop on a signal around them. It runs
on every rank (`lctrain.commands.train` starts the ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lctrain.comm import record_traffic
from lctrain.config import LctrainConfig
from lctrain.config.derived import Stage, context_stages, load_balance_of, stage_banner
from lctrain.config.model_size import param_count
from lctrain.config.resolved import as_dict, to_yaml
from lctrain.data.loader import DataLoader, build_loader
from lctrain.layout.stages import split_layers
from lctrain.models.hf import export_hf, full_parameters
from lctrain.parallel import deepspeed_engine
from lctrain.parallel.data_parallel import (
    data_parallel_engine,
    unwrap,
)
from lctrain.parallel.experts import EP_TAG
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.pipeline import PipelinedModel
from lctrain.parallel.runtime import Runtime, setup_distributed
from lctrain.rundir import RunDir
from lctrain.rundir.checkpoint_dirs import complete_checkpoints
from lctrain.rundir.files import write_atomic
from lctrain.training import progress
from lctrain.training.checkpoint import Checkpointer, TrainState
from lctrain.training.evals import Evaluator, format_table
from lctrain.training.metrics import MetricsLogger, StepMeter
from lctrain.training.optim import build_optimizer, build_scheduler
from lctrain.training.preemption import PreemptionWatcher
from lctrain.training.step import train_step


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm with train.on_nan=stop."""


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
    for line in format_table(results, cfg.eval.tasks, cfg.eval.lengths or [cfg.train.seq_len]):
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
