"""A Llama-3-8B-shaped step (2 layers, 64K or 32K tokens): its loss finite, and `lctrain plan`'s
time and memory beside the measured ones.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from gpu_checks.context import (
    Context,
    device_dtype,
)
from lctrain.config import LctrainConfig, ModelConfig
from lctrain.planning.estimate import rank_memory
from lctrain.planning.hardware import hardware_for
from lctrain.planning.timing import predict_step_time
from lctrain.training import loop

H200_BF16_PEAK = 989e12
"""Dense bf16 FLOP/s of an H100/H200 SXM (datasheet), the MFU denominator."""
def llama8b_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters, output layer included) for forward and
    backward, plus causal attention 6 x n_layers x seq_len x dim (QK^T and PV, 2 FLOPs per
    multiply-add, halved by the causal mask, times 3 for forward + backward)."""
    head_dim = m.dim // m.n_heads
    block = m.dim * head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.dim * m.ffn_dim
    matmuls = m.n_layers * block + m.vocab_size * m.dim
    return 6 * matmuls + 6 * m.n_layers * seq_len * m.dim


def _step_8b_cfg(ctx: Context) -> tuple[LctrainConfig, list[int]]:
    cfg = LctrainConfig()
    if ctx.dry_run:
        cfg.model = ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                ffn_dim=256)
        seq_lens = [256]
    else:
        cfg.model = ModelConfig(name="llama3-8b-2layers", vocab_size=128256, dim=4096, n_layers=2,
                                n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0)
        seq_lens = [65536, 32768]
    cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch = 2, 1, 1
    cfg.train.device, cfg.train.dtype = ctx.device.type, device_dtype(ctx)
    cfg.train.activation_checkpointing = "full"
    cfg.optim.warmup_steps, cfg.logging.progress = 1, False
    return cfg, seq_lens


def check_step_8b(ctx: Context, run_root: Path) -> dict:
    cfg, seq_lens = _step_8b_cfg(ctx)
    errors, history = [], None
    for s in seq_lens:
        cfg.train.seq_len = s
        try:
            history = loop.train(cfg, run_root / f"step-{s}")
        except torch.OutOfMemoryError as e:
            errors.append(f"seq {s}: out of memory ({str(e)[:120]})")
            history = None
        if history is not None:
            break
        torch.cuda.empty_cache()  # outside the except: the failed step's tensors are freed
    if history is None:
        return {"status": "FAIL", "detail": "; ".join(errors), "errors": errors}
    loss = history[-1]["loss"]
    seconds = history[-1]["step_time"]  # the second step: the first compiles and warms up
    tokens_per_s = s / seconds
    mfu = tokens_per_s * llama8b_flops_per_token(cfg.model, s) / H200_BF16_PEAK
    peak = torch.cuda.max_memory_allocated() / 2**30 if ctx.device.type == "cuda" else None
    # what `lctrain plan` predicts for this very run (plan.* H100 defaults on the GPU)
    planned_s = predict_step_time(cfg, 1, hardware_for(
        cfg, gpu_available=ctx.device.type == "cuda")).total_s
    modelled = rank_memory(cfg, 1, 0)["itemised"]["bytes"]["modelled"] / 2**30
    finite = math.isfinite(loss)
    return {"status": "PASS" if finite else "FAIL", "seq_len": s, "loss": loss,
            "tokens_per_s": round(tokens_per_s, 1),
            "mfu": round(mfu, 4), "peak_gib": peak and round(peak, 1), "errors": errors,
            "plan_step_s": float(f"{planned_s:.4g}"), "step_s": float(f"{seconds:.4g}"),
            "plan_over_measured_time": float(f"{planned_s / seconds:.3g}"),
            "plan_modelled_gib": float(f"{modelled:.4g}"),
            "plan_over_measured_memory": peak and float(f"{modelled / peak:.3g}"),
            "detail": f"seq {s}: loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s, MFU "
                      f"{100 * mfu:.1f}% (of {H200_BF16_PEAK / 1e12:.0f} TFLOP/s)"
                      + (f", peak {peak:.1f} GiB" if peak else "")
                      + f"; lctrain plan: {planned_s:.4g} s per step "
                      f"({planned_s / seconds:.2f} x measured), {modelled:.4g} GiB modelled"}
