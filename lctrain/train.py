"""The training loop: build everything in data-flow order, then train() -> train_step() ->
forward_backward(). Runs on every rank; nothing else in lctrain imports this module.

Loss: the sum of token losses over valid targets, divided by the number of valid targets summed
over dp x cp and over the accumulation micro-steps of the step (token-weighted, never a mean of
per-rank means). Gradient reduction averages over dp x cp, so the backward loss is scaled by that
group size to make the reduced gradient the exact gradient of the global token mean.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lctrain.build import (
    Runtime,
    apply_data_parallel,
    build_attention,
    build_model,
    setup_distributed,
)
from lctrain.checkpoint import Checkpointer
from lctrain.comm import record_traffic
from lctrain.config import LctrainConfig, derive
from lctrain.data.batch import IGNORE_INDEX, MicroBatch
from lctrain.data.loader import build_loader
from lctrain.evals import Evaluator, format_table
from lctrain.hf import export_hf, load_hf_weights
from lctrain.launch import PreemptionWatcher
from lctrain.metrics import MetricsLogger
from lctrain.model import Llama
from lctrain.optim import build_optimizer, build_scheduler, clip_grad_norm_
from lctrain.parallelize import apply_activation_checkpointing, apply_tensor_parallel


def check_supported(cfg: LctrainConfig) -> list[str]:
    """Valid layouts this version cannot run yet (lctrain plan still accepts them)."""
    p, problems = cfg.parallel, []
    if p.pp != 1:
        problems.append(f"parallel.pp={p.pp}: pipeline parallelism is not implemented in this "
                        "version; set parallel.pp=1 (lctrain plan accepts the layout)")
    if p.tp > 1 and cfg.model.tie_embeddings:
        problems.append(f"parallel.tp={p.tp} with model.tie_embeddings=true is not supported yet; "
                        "set model.tie_embeddings=false or parallel.tp=1")
    return problems


def _agree_run_dir(run_dir: Path, rt: Runtime) -> Path:
    """Rank 0's run dir: ranks started on different nodes may have resolved ${now:} differently."""
    if rt.world_size == 1:
        return run_dir
    box = [str(run_dir)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _gradient_sync(model: nn.Module, sync: bool):
    """Reduce gradients over dp x cp only on the last accumulation micro-step."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def forward_backward(model: nn.Module, mb: MicroBatch, loss_scale: float,
                     autocast_dtype: torch.dtype | None, cfg: LctrainConfig,
                     rt: Runtime) -> torch.Tensor:
    """Backward of (sum of this rank's token losses) * loss_scale; returns the detached sum."""
    mb = mb.to(rt.device)
    labels = mb.labels
    autocast = (torch.autocast(rt.device.type, dtype=autocast_dtype) if autocast_dtype
                else contextlib.nullcontext())
    with autocast:
        logits = model(mb.inputs, mb.positions, mb.doc_ids)
    if not isinstance(logits, DTensor):
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        (loss_sum * loss_scale).backward()
        return loss_sum.detach()
    with loss_parallel():  # vocab-sharded logits [B, S/cp, V/tp]: no rank holds all of V
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        (loss_sum * loss_scale).backward()
    return loss_sum.detach().full_tensor()


def _all_reduce(x: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.dp_cp_group is not None:
        dist.all_reduce(x, group=rt.dp_cp_group)
    return x


def train_step(model: nn.Module, optimizer, scheduler, micro_batches: list[MicroBatch],
               cfg: LctrainConfig, rt: Runtime) -> dict:
    """One optimizer step over this rank's accumulation micro-batches."""
    local_tokens = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in micro_batches)
    # float64: exact token counts far beyond float32's 2^24
    tokens = _all_reduce(torch.tensor(float(local_tokens), dtype=torch.float64,
                                      device=rt.device), rt)
    group_size = rt.topology.group_size("dp_cp")
    loss_scale = group_size / tokens.item()
    dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else None
    loss_sum = torch.zeros((), device=rt.device, dtype=torch.float32)
    for i, mb in enumerate(micro_batches):
        with _gradient_sync(model, sync=i == len(micro_batches) - 1):
            loss_sum += forward_backward(model, mb, loss_scale, dtype, cfg, rt)
    grad_norm = clip_grad_norm_(list(model.parameters()), cfg.optim.grad_clip)
    loss = _all_reduce(loss_sum, rt) / tokens
    lr = scheduler.get_last_lr()[0]
    # the same global values on every rank, so every rank takes the same decision
    finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
    if finite:  # a non-finite update would destroy the weights: never apply it
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
            "valid_tokens": int(tokens.item()), "skipped": int(not finite)}


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient norm with train.on_nan=stop."""


def _build(cfg: LctrainConfig, rt: Runtime):
    """Model (TP, HF weights, checkpointing, DP), optimizer and schedule, in that order."""
    model = build_model(cfg, rt.device, build_attention(cfg, rt))
    if cfg.parallel.tp > 1:
        model = apply_tensor_parallel(model, rt.mesh["tp"], cfg.parallel.sp)
    if cfg.model.init_from is not None:
        load_hf_weights(model, cfg.model.init_from)  # each rank reads its TP slice
    model = apply_activation_checkpointing(model, cfg.train.activation_checkpointing,
                                           cfg.parallel.cp)
    model = apply_data_parallel(model, cfg, rt)
    optimizer = build_optimizer(model, cfg.optim)
    return model, optimizer, build_scheduler(optimizer, cfg.optim, cfg.train.steps)


def train(cfg: LctrainConfig, run_dir: str | os.PathLike) -> list[dict]:
    """Train on this rank; returns the metrics of every step run (identical on all ranks)."""
    from lctrain.compose import as_dict, to_yaml

    rt = setup_distributed(cfg)
    run_dir = _agree_run_dir(Path(run_dir), rt)
    watcher = PreemptionWatcher(run_dir / "STOP", rt.rank)
    if rt.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    derived = derive(cfg, rt.world_size)
    torch.manual_seed(cfg.train.seed)
    model, optimizer, scheduler = _build(cfg, rt)
    loader = build_loader(cfg, rt.topology, rt.rank, derived.grad_accum)
    metrics = MetricsLogger(cfg.logging, run_dir, rt.rank, cfg.train.steps, as_dict(cfg))
    metrics.info(f"lctrain: {rt.world_size} rank(s) on {rt.device.type}, layout "
                 f"{rt.topology.shape} (pp, dp, cp_ring, cp_ulysses, tp), grad_accum "
                 f"{derived.grad_accum}, {Llama.num_params(model):,} parameters")
    if getattr(loader.source, "dropped", 0):
        metrics.info(f"lctrain: data.long_docs=drop skips {loader.source.dropped:,} documents "
                     f"longer than train.seq_len={cfg.train.seq_len}")
    checkpointer = Checkpointer(cfg, rt, run_dir, to_yaml(cfg), metrics.info)
    evaluator = Evaluator(cfg, rt)
    history: list[dict] = []
    try:
        state = checkpointer.maybe_resume(model, optimizer, scheduler, loader)
        for step in range(state.step + 1, cfg.train.steps + 1):
            out = _run_step(model, optimizer, scheduler, loader, cfg, rt, derived)
            if out["skipped"]:
                if cfg.train.on_nan == "stop":
                    raise NonFiniteError(
                        f"step {step}: loss {out['loss']}, grad norm {out['grad_norm']}; the "
                        "update was not applied (train.on_nan=stop). Resume from the last "
                        "checkpoint with a lower optim.lr, check the data, or set "
                        "train.on_nan=skip")
                metrics.info(f"lctrain: warning: step {step} skipped: loss {out['loss']}, grad "
                             f"norm {out['grad_norm']} (train.on_nan=skip)")
            state.step, state.tokens = step, state.tokens + derived.tokens_per_step
            out.update(step=step, tokens=state.tokens)
            evaluated = evaluator.should_run(step)
            if evaluated:
                results = evaluator.run(model)
                out.update(results)
                for line in format_table(results, cfg.eval.tasks):
                    metrics.info(line)
            stop = watcher.requested(rt)
            if checkpointer.should_save(step) or stop:
                t0 = time.perf_counter()
                checkpointer.save(step, model, optimizer, loader, state, wait=stop)
                out["checkpoint_stall"] = time.perf_counter() - t0
            history.append(out)
            if metrics.should_log(step) or evaluated or stop:
                metrics.log(step, {k: v for k, v in out.items() if k != "step"})
            if stop:
                metrics.info(f"lctrain: stopping after step {step} ({watcher.reason}); the "
                             "checkpoint is saved: run again with checkpoint.resume=auto")
                break
        checkpointer.wait()
        if cfg.checkpoint.export_hf is not None and not watcher.reason:
            export_hf(model, cfg.model, cfg.checkpoint.export_hf, rt.rank)
            metrics.info(f"lctrain: exported Hugging Face weights to {cfg.checkpoint.export_hf}")
    finally:
        checkpointer.close()
        watcher.restore()
        metrics.close()
    return history


def _run_step(model, optimizer, scheduler, loader, cfg: LctrainConfig, rt: Runtime,
              derived) -> dict:
    """One step with its timings and traffic."""
    t0 = time.perf_counter()
    micro_batches = loader.next_step()
    data_time = time.perf_counter() - t0
    with record_traffic() as traffic:
        out = train_step(model, optimizer, scheduler, micro_batches, cfg, rt)
    elapsed = time.perf_counter() - t0
    out.update(step_time=elapsed, data_time=data_time,
               tokens_per_sec=derived.tokens_per_step / elapsed,
               cp_bytes_sent=sum(traffic.bytes.values()))
    return out
