"""Training on the GPU: 20 tiny steps in bf16 against fp32 on the CPU, torch.compile, one
checkpoint save and resume, the host-to-device batch copy.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gpu_checks.context import (
    Context,
    device_dtype,
    largest_relative_difference,
    tiny_cfg,
)
from lctrain.config import LctrainConfig
from lctrain.data.batch import micro_batch_from_tokens
from lctrain.training import loop


def check_train_tiny(ctx: Context, run_root: Path) -> dict:
    steps = 3 if ctx.dry_run else 20
    cpu = loop.train(tiny_cfg(steps, "cpu", "fp32"), run_root / "cpu")
    dev = loop.train(tiny_cfg(steps, ctx.device.type, device_dtype(ctx)), run_root / "device")
    diff = largest_relative_difference(cpu, dev)
    tolerance = 1e-5 if ctx.dry_run else 0.03
    return {"status": "PASS" if diff <= tolerance else "FAIL",
            "losses_cpu": [round(h["loss"], 4) for h in cpu],
            "losses_device": [round(h["loss"], 4) for h in dev],
            "detail": f"{steps} steps, largest relative loss difference {diff:.4f} "
                      f"(tolerance {tolerance})"}


def check_compile(ctx: Context, run_root: Path) -> dict:
    """torch.compile of the blocks and the loss head: the eager run's losses. A dry run compiles
    with dynamo's aot_eager backend (tracing and the compiled autograd graph, no code
    generation: inductor's C++ build takes over a minute on a small CPU)."""
    if ctx.dry_run:
        eager_compile = torch.nn.Module.compile
        torch.nn.Module.compile = lambda self, **kw: eager_compile(self, backend="aot_eager")
    histories, seconds = {}, {}
    for compiled in (False, True):
        cfg = tiny_cfg(3, ctx.device.type, device_dtype(ctx))
        cfg.train.compile = compiled
        if ctx.dry_run:
            cfg.model.n_layers, cfg.train.seq_len = 1, 64
        t0 = time.perf_counter()
        histories[compiled] = loop.train(cfg, run_root / f"compile-{compiled}")
        seconds[compiled] = time.perf_counter() - t0
    diff = largest_relative_difference(histories[False], histories[True])
    tolerance = 1e-4 if ctx.dry_run else 1e-2
    return {"status": "PASS" if diff <= tolerance else "FAIL",
            "eager_s": round(seconds[False], 1), "compiled_s": round(seconds[True], 1),
            "detail": f"3 steps, largest relative loss difference {diff:.2e} (tolerance "
                      f"{tolerance}); eager {seconds[False]:.1f} s, compiled "
                      f"{seconds[True]:.1f} s including compilation"}


def check_checkpoint_resume(ctx: Context, run_root: Path) -> dict:
    """Save at step 2 of 4, resume a fresh run from it: steps 3 and 4 as the uninterrupted run
    (deterministic attention backward on CUDA)."""
    def cfg_for(load: Path | None = None) -> LctrainConfig:
        cfg = tiny_cfg(4, ctx.device.type, device_dtype(ctx))
        cfg.train.deterministic = not ctx.dry_run
        cfg.checkpoint.every, cfg.checkpoint.keep = 2, 0
        cfg.checkpoint.load = load and str(load)
        return cfg

    whole = loop.train(cfg_for(), run_root / "whole")
    saved = run_root / "whole" / "checkpoints" / "step-00000002"
    resumed = loop.train(cfg_for(saved), run_root / "resumed")
    steps = [h["step"] for h in resumed]
    diff = largest_relative_difference(whole[-2:], resumed[-2:])
    tolerance = 1e-6 if ctx.dry_run else 1e-3
    ok = steps == [3, 4] and diff <= tolerance
    return {"status": "PASS" if ok else "FAIL", "resumed_steps": steps,
            "detail": f"resumed at step {steps[0] if steps else None}; steps 3-4 loss vs the "
                      f"uninterrupted run: largest relative difference {diff:.2e} "
                      f"(tolerance {tolerance})"}


def check_batch_transfer(ctx: Context) -> dict:
    tokens = torch.randint(1, 100, (2, 65))
    lengths = [torch.tensor([30, 35]).numpy()] * 2
    mb = micro_batch_from_tokens(tokens, 64, lengths=lengths, document_masking=True)
    moved = mb.to(ctx.device)
    ok = (moved.inputs.device.type == ctx.device.type and moved.doc_ids is mb.doc_ids
          and torch.equal(moved.inputs.cpu(), mb.inputs))
    return {"status": "PASS" if ok else "FAIL",
            "detail": f"inputs on {moved.inputs.device}, document ids stay on the host"}
