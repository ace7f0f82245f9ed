"""AdamW with decay only on matrices, warmup + cosine schedule, global grad-norm clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lctrain.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; norms (1-D) and embeddings get no weight decay.

    DTensor and plain parameters go to separate groups: foreach kernels cannot mix them (they do
    mix when TP shards some modules and no FSDP wraps the rest).
    """
    groups: dict[tuple[bool, bool], list] = {}
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        decay = p.ndim >= 2 and "tok_embeddings" not in name
        groups.setdefault((decay, isinstance(p, DTensor)), []).append(p)
    param_groups = [{"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0}
                    for (decay, _), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0],
                                                                                   kv[0][1]))]
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             foreach=True)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine or constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    # LambdaLR multiplies the base lr (cfg.lr) by the factor.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)


def resume_scheduler(scheduler, step: int) -> None:
    """Put a `build_scheduler` schedule where it is after `step` optimizer steps: the schedule
    is a function of the step alone, so this is exact under any layout (any param groups)."""
    scheduler.last_epoch = step
    lrs = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients (DTensor shards included); clip when max_norm > 0.

    DTensor gradients (TP and/or FSDP shards) reduce their partial norms over their mesh, so the
    result is the norm of the full, unsharded gradient on every rank. Plain gradients (modules
    left out of the TP plan) are replicated, so their local norm is already the full one. With
    pipeline parallelism each rank holds other layers: the squares add up over `pp_group`.
    """
    # foreach kernels take one kind of tensor at a time: plain, or DTensors of one mesh (TP
    # without SP leaves the norms FSDP-sharded on dp x cp alone, the matmuls on dp x cp x tp)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p.grad)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
