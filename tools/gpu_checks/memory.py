"""Memory on the GPU: selective checkpointing's activation bytes against the formula, offload and
the tiled loss and MLP, the training state in host memory (parallel.offload_state) against the
plan.
"""

from __future__ import annotations

import torch

from gpu_checks.context import (
    Context,
    device_dtype,
    tiny_cfg,
)
from lctrain.config import LctrainConfig
from lctrain.data.loader import build_loader
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.planning.activations import activation_formula
from lctrain.planning.state import host_state_parts
from lctrain.tracing.measure import (
    build_measured_model,
    measure_activations,
    measure_host_state,
)
from lctrain.training.optim import build_optimizer, build_scheduler
from lctrain.training.step import train_step


def measure_block_activations(cfg: LctrainConfig, batch: int) -> float:
    """Bytes one block keeps for the backward, measured with one forward of `cfg`'s model on
    one process: the last block's (the first also plans what every block shares)."""
    model, run_forward = build_measured_model(cfg, batch)
    return measure_activations(model, run_forward)[list(unwrap(model).layers)[-1]]


def check_selective_memory(ctx: Context) -> dict:
    rows = []
    for mode in ("none", "selective", "full"):
        cfg = tiny_cfg(1, ctx.device.type, "fp32")
        cfg.data.document_masking, cfg.train.activation_checkpointing = False, mode
        got = measure_block_activations(cfg, batch=2)
        want = activation_formula(cfg, 1, batch=2)
        rows.append({"mode": mode, "measured": got, "formula": want,
                     "ratio": round(got / want, 4)})
    ok = all(abs(r["ratio"] - 1) <= 0.05 for r in rows)
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": ", ".join(f"{r['mode']} {r['ratio']:.3f}" for r in rows) +
                      " (measured / formula, fp32, within 5%)"}


def _forward_backward_memory(cfg: LctrainConfig, device: torch.device) -> dict:
    """One training forward + backward: the bytes on the device after the forward and at the
    peak (CUDA allocator counters; None on the CPU), the loss and every gradient."""
    model, run_forward = build_measured_model(cfg, batch=cfg.train.micro_batch)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss = run_forward()
    kept = torch.cuda.memory_allocated() - base if cuda else None
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    return {"kept": kept, "peak": peak, "loss": loss.item(), "grads": grads}


def check_offload_and_tiling(ctx: Context) -> dict:
    """Offload, the tiled loss and the tiled MLP on the device: the gradients of the plain path
    (bit for bit on the CPU; on CUDA within the bf16 tolerance, since the attention backward
    sums dq in a nondeterministic order), and less device memory: offload keeps almost nothing
    on the device between forward and backward, the tilings lower the peak."""
    seq = 256 if ctx.dry_run else 8192
    variants = {"plain": {}, "offload": {"offload_activations": True},
                "loss_chunk": {"loss_chunk": seq // 8}, "mlp_chunk": {"mlp_chunk": seq // 8}}
    runs = {}
    for name, keys in variants.items():
        cfg = tiny_cfg(1, ctx.device.type, device_dtype(ctx))
        cfg.train.seq_len, cfg.train.activation_checkpointing = seq, "full"
        for key, value in keys.items():
            setattr(cfg.train, key, value)
        runs[name] = _forward_backward_memory(cfg, ctx.device)
    plain = runs["plain"]
    rows, ok = [], True
    for name, got in runs.items():
        worst = max(float((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-12))
                    for n, g in plain["grads"].items())
        exact = ctx.dry_run and name == "offload"
        tolerance = 0.0 if exact else (1e-5 if ctx.dry_run else 2e-2)
        row = {"variant": name, "loss": round(got["loss"], 5), "worst_grad_rel_diff": worst,
               "kept_mib": got["kept"] and round(got["kept"] / 2**20, 2),
               "peak_mib": got["peak"] and round(got["peak"] / 2**20, 2)}
        ok &= worst <= tolerance
        if ctx.device.type == "cuda" and name == "offload":
            ok &= got["kept"] <= 0.25 * plain["kept"]
        elif ctx.device.type == "cuda" and name != "plain":
            ok &= got["peak"] < plain["peak"]
        rows.append(row)
    memory = ("device MiB kept / peak: " + ", ".join(
        f"{r['variant']} {r['kept_mib']} / {r['peak_mib']}" for r in rows)
        if ctx.device.type == "cuda" else "memory not compared on the CPU")
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": f"gradients vs plain within tolerance: {ok}; {memory}"}


def _offloaded_steps(cfg: LctrainConfig) -> dict:
    """Three steps of `cfg` on this process: the losses, the bytes of the host storages the
    offloaded state holds after each step (FSDP's shards, gradients and moments under
    optimizer+params, HostAdamW's buffers and moments under optimizer), how many of them are
    pinned, and the device bytes allocated after the last."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    mode = cfg.parallel.offload_state
    optimizer = build_optimizer(model, cfg.optim, on_host=mode == "optimizer")
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
    host: list[tuple[int, int]] = []
    optimizer.register_step_post_hook(
        lambda opt, *_: host.append(measure_host_state(model, opt, mode)))
    losses = [train_step(model, optimizer, scheduler, loader.next_step(), cfg, rt)["loss"]
              for _ in range(cfg.train.steps)]
    allocated = torch.cuda.memory_allocated() if rt.device.type == "cuda" else 0
    total, pinned = host[-1]
    return {"losses": losses, "host_bytes": total, "pinned_bytes": pinned,
            "device_bytes": allocated}


def check_state_offload(ctx: Context) -> dict:
    """parallel.offload_state on one rank of the device: each mode's losses against the state
    on the device (fp32: HostAdamW exact, FSDP's offload to float32 rounding), the host bytes
    of the offloaded state against `host_state_parts` (exact; the pinned share reported), and
    the device bytes each mode leaves."""
    rows, ok = [], True
    for mode in ("none", "optimizer", "optimizer+params"):
        cfg = tiny_cfg(3, ctx.device.type, "fp32")
        cfg.train.deterministic = not ctx.dry_run
        cfg.parallel.offload_state = mode
        got = _offloaded_steps(cfg)
        want = sum(host_state_parts(cfg, 1).values())
        rows.append({"mode": mode, **got, "host_bytes_predicted": want})
        ok = ok and got["host_bytes"] == want
    for row in rows[1:]:
        row["largest_relative_loss_difference"] = max(
            abs(a - b) / abs(b) for a, b in zip(row["losses"], rows[0]["losses"]))
        ok = ok and row["largest_relative_loss_difference"] <= 1e-5
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": ", ".join(f"{r['mode']}: host {r['host_bytes']:,} B (predicted "
                                f"{r['host_bytes_predicted']:,.0f}; pinned {r['pinned_bytes']:,}),"
                                f" device {r['device_bytes']:,} B"
                                + (f", loss diff {r['largest_relative_loss_difference']:.1e}"
                                   if "largest_relative_loss_difference" in r else "")
                                for r in rows)}
