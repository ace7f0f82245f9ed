"""What every check shares: the Context (dry run or GPU, its device, backends, dtype and
tolerances), the environment check, and the small helpers the check families use.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from lctrain.attention.cuda_kernels import flash_attn_installed
from lctrain.attention.kernels import KERNEL_CODE, KernelOptions
from lctrain.config import LctrainConfig, ModelConfig
from lctrain.config.kernel_backends import backends_on

BF16_TOL, BF16_GQA_TOL = 2.5e-2, 3.5e-2
"""Relative and absolute bf16 tolerances against float64, as Transformer Engine's context-parallel
tests use them (wider with GQA, whose dK/dV sum several query heads)."""


@dataclass(frozen=True)
class Context:
    dry_run: bool
    quick: bool

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.dry_run else torch.device("cuda", 0)

    @property
    def backends(self) -> list[str]:
        """The backends checked: the CUDA ones (flash_attn when installed), or in a dry run the
        torch backend through its CPU implementation beside the CPU ones."""
        if self.dry_run:
            return ["torch", "reference", "cpu"]
        return [n for n in backends_on("cuda") if KERNEL_CODE[n].installed()]

    @property
    def kernel(self) -> KernelOptions:
        return KernelOptions(backend="torch")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.dry_run else torch.bfloat16

    def tol(self, gqa: bool) -> float:
        return 1e-4 if self.dry_run else (BF16_GQA_TOL if gqa else BF16_TOL)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def check_env(ctx: Context) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "flash_attn": None}
    if flash_attn_installed():
        import flash_attn  # optional extra

        info["flash_attn"] = flash_attn.__version__
    if ctx.device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability(),
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                    torch_flash=torch.backends.cuda.is_flash_attention_available())
        if not info["torch_flash"]:
            return {"status": "FAIL", "detail": "this torch build has no flash attention", **info}
    return {"status": "PASS", "detail": ", ".join(f"{k} {v}" for k, v in info.items()), **info}


def qkv(b, s, h, hkv, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=gen).to(device, dtype)
            for n in (h, hkv, hkv)] + [torch.randn(b, s, h, d, generator=gen).to(device, dtype)]


def error_over_tolerance(pairs, tol: float) -> float:
    """Largest |got - want| - tol * |want| over the pairs, in units of tol (<= 1 passes)."""
    worst = 0.0
    for got, want in pairs:
        err = (got.double() - want).abs() - tol * want.abs()
        worst = max(worst, float(err.max()) / tol)
    return worst


def tiny_cfg(steps: int, device: str, dtype: str) -> LctrainConfig:
    cfg = LctrainConfig()
    cfg.model = ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=256)
    cfg.train.steps, cfg.train.seq_len, cfg.train.global_batch = steps, 256, 2
    cfg.train.micro_batch, cfg.train.device, cfg.train.dtype = 2, device, dtype
    cfg.data.source, cfg.data.document_masking = "passkey", True
    cfg.optim.warmup_steps, cfg.logging.progress = 2, False
    return cfg


def device_dtype(ctx: Context) -> str:
    return "fp32" if ctx.dry_run else "bf16"


def largest_relative_difference(a: list[dict], b: list[dict]) -> float:
    return max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))


def timed(fn, ctx: Context, reps: int) -> float:
    fn()
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    ctx.sync()
    return (time.perf_counter() - t0) / reps
