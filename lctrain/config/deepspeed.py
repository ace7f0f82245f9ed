"""The DeepSpeed JSON keys lctrain derives from its own configuration, and the keys of
deepspeed.config that would contradict them: pure, so that validation can check them before
anything starts (lctrain.parallel.deepspeed_engine builds the engine)."""

from __future__ import annotations

from typing import Any

from lctrain.config.schema import LctrainConfig


def lctrain_keys(cfg: LctrainConfig, grad_accum: int) -> dict[str, Any]:
    """The DeepSpeed JSON keys lctrain decides: batch sizes, ZeRO stage and offload, precision,
    clipping. The optimizer and the lr schedule are lctrain's own (AdamW, `build_scheduler`)."""
    ds, t = cfg.deepspeed, cfg.train
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": grad_accum,
            "zero_optimization": zero,
            "bf16": {"enabled": t.dtype == "bf16"},
            "gradient_clipping": cfg.optim.grad_clip}


def conflicts(cfg: LctrainConfig, grad_accum: int) -> list[str]:
    """Keys of deepspeed.config that contradict lctrain's (or take over its optimizer, lr
    schedule or batch size, which lctrain owns)."""
    ours = _flatten(lctrain_keys(cfg, grad_accum))
    problems = []
    for key, value in _flatten(cfg.deepspeed.config).items():
        if key in ("optimizer", "scheduler", "train_batch_size", "fp16") or key.startswith(
                ("optimizer.", "scheduler.", "fp16.")):
            problems.append(f"deepspeed.config.{key}={value!r}: lctrain sets the optimizer "
                            "(optim.*), the lr schedule, the batch size (train.global_batch) and "
                            "the precision (train.dtype); remove the key")
        elif key in ours and ours[key] != value:
            problems.append(f"deepspeed.config.{key}={value!r} contradicts lctrain's "
                            f"{ours[key]!r} ({_owner(key)}); remove the key or set {_owner(key)}")
    return problems


def _owner(key: str) -> str:
    return {"train_micro_batch_size_per_gpu": "train.micro_batch",
            "gradient_accumulation_steps": "train.global_batch",
            "zero_optimization.stage": "deepspeed.zero_stage",
            "zero_optimization.offload_optimizer.device": "deepspeed.offload_optimizer",
            "zero_optimization.offload_param.device": "deepspeed.offload_param",
            "bf16.enabled": "train.dtype",
            "gradient_clipping": "optim.grad_clip"}.get(key, "lctrain's key")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
