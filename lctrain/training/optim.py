"""AdamW with decay only on matrices, warmup + cosine schedule, global grad-norm clipping."""

from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from lctrain import device
from lctrain.config import OptimConfig
from lctrain.parallel.tensor import laid_out_as, local_part


def build_optimizer(model: nn.Module, cfg: OptimConfig, on_host: bool = False
                    ) -> torch.optim.AdamW:
    """AdamW (`HostAdamW` when `on_host`: parallel.offload_state=optimizer); norms (1-D) and
    embeddings get no weight decay.

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
    kind = HostAdamW if on_host else torch.optim.AdamW
    return kind(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                foreach=True)


class HostAdamW(torch.optim.AdamW):
    """AdamW whose moments live in host memory and whose step runs there
    (parallel.offload_state=optimizer; docs/parallelism.md §22).

    The param groups hold the model's parameters, so the lr schedule, clipping and checkpoints
    see an ordinary AdamW; `state[p]` holds host tensors ("exp_avg", "exp_avg_sq": DTensors
    with host shards for a DTensor parameter, so checkpoints shard and reshard them as any
    AdamW state). A step copies each gradient and weight into the parameter's host buffers
    (pinned on CUDA), runs torch's AdamW arithmetic there (the same foreach kernels), and copies
    the weights back: the device AdamW's result bit for bit. Host bytes per local parameter:
    4 (weight buffer) + 4 (gradient buffer) + 8 (moments)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.buffers: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self.register_load_state_dict_post_hook(HostAdamW._state_to_host)

    def _pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu",
                           pin_memory=device.pins(like.device))

    def _host_state(self, p: torch.Tensor) -> dict:
        """`state[p]`, created in host memory at the first step."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = self._as_param(p, self._pinned(local_part(p)).zero_())
        return state

    @staticmethod
    def _as_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """`local` laid out as `p` (a DTensor with the same mesh and placements for a DTensor
        parameter)."""
        if not isinstance(p, DTensor):
            return local
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    @staticmethod
    def _state_to_host(optimizer: HostAdamW) -> None:
        """After load_state_dict (which puts state on each parameter's device): back to host."""
        for p, state in optimizer.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                value = state.get(key)
                if value is not None and local_part(value).device.type != "cpu":
                    state[key] = optimizer._as_param(
                        p, optimizer._pinned(local_part(value)).copy_(local_part(value)))

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "HostAdamW takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p not in self.buffers:
                    self.buffers[p] = (self._pinned(local_part(p)), self._pinned(local_part(p)))
                weight, grad = self.buffers[p]
                weight.copy_(local_part(p), non_blocking=True)
                grad.copy_(local_part(laid_out_as(p.grad, p)), non_blocking=True)
            for d in {p.device for p in params}:  # the copies above were asynchronous
                device.synchronize(d)
            states = [self._host_state(p) for p in params]
            beta1, beta2 = group["betas"]
            adam(
                [self.buffers[p][0] for p in params], [self.buffers[p][1] for p in params],
                [local_part(s["exp_avg"]) for s in states],
                [local_part(s["exp_avg_sq"]) for s in states],
                [], [s["step"] for s in states], foreach=group["foreach"],
                decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=group["maximize"])
            for p in params:
                local_part(p).copy_(self.buffers[p][0], non_blocking=True)
        return None


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


REDISTRIBUTE_LOG = "torch.distributed.tensor._redistribute"
"""Where torch says, once per mesh, that it reduces a value partial over a 2-D mesh (the norm
over dp x cp and tp) one dimension at a time and that a flattened mesh would take one call:
two all-reduces of one number per step, a latency cost, against a communicator more per rank
(its buffers on every GPU) to flatten dp x cp x tp. Not worth a warning in every TP run."""


@contextlib.contextmanager
def _quiet(logger_name: str):
    """The named logger's warnings dropped inside the block."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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
        with _quiet(REDISTRIBUTE_LOG):
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
