"""The DeepSpeed ZeRO engine (parallel.dp_engine=deepspeed): the DeepSpeed JSON config lctrain
derives from its own keys, the mpu that hands DeepSpeed lctrain's groups, the engine around
an already built model and lctrain's AdamW, one step's micro-batches under it (`micro_steps`,
called by lctrain.training.loop with its token-weighted loss scale), and its checkpoints.

Groups: DeepSpeed's data-parallel group is dp x cp, so ZeRO shards and averages over the same
ranks as FSDP, and every cp algorithm runs unchanged inside the model (`GroupsForDeepSpeed`).
deepspeed is imported here only, when the engine is asked for.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lctrain.config import LctrainConfig
from lctrain.config.deepspeed import lctrain_keys
from lctrain.data.batch import MicroBatch
from lctrain.parallel.runtime import Runtime

INSTALL = ('pip install -e ".[deepspeed]" (the first process on a machine compiles DeepSpeed\'s '
           'shared-memory op once into torch\'s extension cache, about a minute on 2 cores)')


def environment_problems(cfg: LctrainConfig) -> list[str]:
    """deepspeed importable, and the DeepSpeed config lctrain would pass accepted by DeepSpeed's
    own parser, every top-level key of deepspeed.config read by it (it ignores the others)."""
    if importlib.util.find_spec("deepspeed") is None:
        return [f"parallel.dp_engine=deepspeed but deepspeed is not installed; run {INSTALL}, "
                "or set parallel.dp_engine=fsdp"]
    from deepspeed.runtime.config import DeepSpeedConfig  # optional: only for this engine

    config = _ReadKeys(deepspeed_config(cfg, grad_accum=1))
    try:
        DeepSpeedConfig(config)
    except Exception as e:  # noqa: BLE001 (any parse error is the user's config)
        detail = " ".join(str(e).split())
        return [f"deepspeed.config is not accepted by DeepSpeed: {type(e).__name__}: {detail}"]
    return [f"deepspeed.config.{key} is not a DeepSpeed config key (DeepSpeed would ignore "
            "it); check its spelling against the DeepSpeed config documentation"
            for key in cfg.deepspeed.config if key not in config.read]


class _ReadKeys(dict):
    """A dict that remembers which keys were looked up."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


class GroupsForDeepSpeed:
    """The mpu DeepSpeed asks for its groups: data parallel = dp x cp, model parallel = tp (1:
    validation refuses TP here). Context parallelism stays inside lctrain's model, so DeepSpeed
    sees no sequence parallelism: ZeRO shards and averages over dp x cp like FSDP. (Declaring cp
    as DeepSpeed's sequence-parallel group, as DeepSpeed-Ulysses does, gave ZeRO-3 wrong
    gradients here: a step-1 grad norm of 1.08 instead of 1.61 at dp2 x cp2.)"""

    def __init__(self, rt: Runtime):
        self.rt = rt

    def get_model_parallel_group(self):
        return self.rt.group("tp")

    def get_model_parallel_rank(self) -> int:
        return self.rt.axis_rank("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.rt.topology.group_size("tp")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_group(self):
        return self.rt.group("dp_cp")

    def get_data_parallel_rank(self) -> int:
        return self.rt.axis_rank("dp_cp")

    def get_data_parallel_world_size(self) -> int:
        return self.rt.topology.group_size("dp_cp")


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: LctrainConfig,
               rt: Runtime) -> nn.Module:
    """The DeepSpeed engine around `model` (materialised, no FSDP/DDP) and lctrain's AdamW."""
    import deepspeed  # optional dependency: only for this engine

    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_config(cfg, rt.derived.grad_accum),
                                      mpu=GroupsForDeepSpeed(rt))
    return engine


def deepspeed_config(cfg: LctrainConfig, grad_accum: int) -> dict[str, Any]:
    """The DeepSpeed JSON config: lctrain's keys, then deepspeed.config merged over them."""
    config = {**lctrain_keys(cfg, grad_accum), "steps_per_print": 2**62,
              # lctrain's torch AdamW also with the optimizer state on the host (DeepSpeed's
              # CPU Adam would compile a C++ op and differ in numerics)
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    return _merge(config, cfg.deepspeed.config)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def is_engine(model: nn.Module) -> bool:
    """Whether `model` is a DeepSpeed engine (deepspeed is not imported for the question)."""
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


def micro_steps(engine: nn.Module, micro_batches: list[MicroBatch], loss_scale: Tensor | float,
                rt: Runtime) -> torch.Tensor:
    """Forward and backward of every micro-batch of one step; the sum of this rank's token
    losses. The backward loss is the token-loss sum times `loss_scale` (the training loop's
    token weighting): DeepSpeed's own division by the accumulation steps is off. The engine
    steps its optimizer at the accumulation boundary only, after its global clipping, and skips
    a step with a non-finite gradient norm (`was_step_applied`)."""
    loss_sum = torch.zeros((), device=rt.device, dtype=torch.float32)
    for mb in micro_batches:
        mb = mb.to(rt.device)
        with rt.autocast():
            loss = engine(mb.inputs, positions=mb.positions, doc_ids=mb.doc_ids, labels=mb.labels)
        engine.backward(loss * loss_scale, scale_wrt_gas=False)
        engine.step()  # the optimizer steps at the accumulation boundary only
        loss_sum += loss.detach().float()
    return loss_sum


def grad_norm(engine: nn.Module) -> float:
    """The global gradient norm of the engine's last step (nan when DeepSpeed has none)."""
    norm = engine.get_global_grad_norm()
    return float("nan") if norm is None or norm < 0 else float(norm)


TAG = "deepspeed"
"""The folder of a checkpoint that holds the DeepSpeed engine's own files."""


def save(engine: nn.Module, directory: Path) -> None:
    """The engine's weights and ZeRO optimizer state into directory/deepspeed (collective)."""
    engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)


def load(engine: nn.Module, directory: Path) -> None:
    """What `save` wrote, into an engine of the same ZeRO stage (collective); the lr schedule is
    lctrain's and is not read."""
    engine.load_checkpoint(str(directory), tag=TAG, load_lr_scheduler_states=False)


def full_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The whole fp32 weights of a checkpoint `save` wrote, ZeRO shards consolidated."""
    from deepspeed.utils.zero_to_fp32 import (  # optional dependency: only for this engine
        get_fp32_state_dict_from_zero_checkpoint,
    )

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG))


def load_full_weights(engine: nn.Module, state: dict[str, torch.Tensor], zero_stage: int) -> None:
    """Whole weights (from another engine's checkpoint) into the engine: under ZeRO-3 gathered,
    set on rank 0 and partitioned again; then the optimizer's fp32 copies are refreshed."""
    import deepspeed  # optional dependency: only for this engine

    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                               modifier_rank=0):
            if dist.get_rank() == 0:
                engine.module.load_state_dict(state)
    else:
        engine.module.load_state_dict(state)
    engine.optimizer.refresh_fp32_params()
