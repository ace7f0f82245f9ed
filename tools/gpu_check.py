"""Check lctrain's CUDA path on one GPU: PASS / FAIL / SKIP per check, written to a JSON file after
every check, so that a hang or a crash loses nothing already measured.

    python tools/gpu_check.py --out OUT/gpu_check.json [--budget 420] [--quick]  # on a GPU
    python tools/gpu_check.py --dry-run --out gpu_check.json                     # CPU: wiring

Each check runs in a process of its own with its own time limit (a hang, an out-of-memory
crash or a wedged CUDA context fails that check only); an exception is FAIL, and SKIP is kept
for a stated precondition (flash-attn not installed, the budget spent). `--budget` stops
starting checks whose expected time no longer fits. It needs torch only: no flash-attn, hydra,
deepspeed, wandb or datasets (docs/gpu.md gives the one command for an offline GPU machine).

Checks: the environment; every attention backend against float64 (dense and packed documents,
causal or not, MHA / GQA / MQA, bf16 tolerances 2.5e-2 and 3.5e-2 with GQA) and the torch
backend's deterministic backward; every context-parallel algorithm with packed documents on 2
and 4 ranks sharing the GPU (gloo, collectives staged through host memory); 20 tiny steps in
bf16 on CUDA against fp32 on the CPU; selective checkpointing's activation bytes; offload and
the tiled loss and MLP; the training state in host memory (parallel.offload_state: losses, pinned
bytes against the plan); torch.compile; one checkpoint save and resume; a Llama-3-8B-shaped step
(2 layers, 64K or 32K tokens) with its loss finite and `lctrain plan`'s time and memory beside
the measured ones; attention throughput in TFLOP/s per backend at 8K / 32K / 128K against the
device's bf16 matmul rate; the host-to-device batch copy.

--dry-run runs the same code on the CPU with tiny sizes: the torch backend through a CPU
implementation of its ops that enforces the CUDA ops' argument rules, so that a change that
breaks the script shows before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lctrain.attention import ContextParallelAttention  # noqa: E402
from lctrain.attention.calls import Block  # noqa: E402
from lctrain.attention.cuda_kernels import flash_attn_installed  # noqa: E402
from lctrain.attention.kernels import KERNEL_CODE, KernelOptions  # noqa: E402
from lctrain.attention.local import local_attention  # noqa: E402
from lctrain.attention.varlen_reference import register_cpu_flash_ops  # noqa: E402
from lctrain.config import LctrainConfig, ModelConfig  # noqa: E402
from lctrain.config.cp_algorithms import algorithm_layouts  # noqa: E402
from lctrain.config.kernel_backends import backends_on  # noqa: E402
from lctrain.data.batch import micro_batch_from_tokens  # noqa: E402
from lctrain.data.loader import build_loader  # noqa: E402
from lctrain.layout import sequence  # noqa: E402
from lctrain.layout.comm import check_collective_devices  # noqa: E402
from lctrain.models.moe import grouped_matmul  # noqa: E402
from lctrain.parallel.data_parallel import unwrap  # noqa: E402
from lctrain.parallel.launch import RankFailure, run_ranks  # noqa: E402
from lctrain.parallel.parallelize import build_model  # noqa: E402
from lctrain.parallel.runtime import setup_distributed  # noqa: E402
from lctrain.planning.estimate import rank_memory  # noqa: E402
from lctrain.planning.hardware import hardware_for  # noqa: E402
from lctrain.planning.memory import activation_formula, host_state_parts  # noqa: E402
from lctrain.planning.timing import predict_step_time  # noqa: E402
from lctrain.training import loop  # noqa: E402
from lctrain.training.measure import (  # noqa: E402
    build_measured_model,
    measure_activations,
    measure_host_state,
)
from lctrain.training.optim import build_optimizer, build_scheduler  # noqa: E402
from tests.reference import reference_attention  # noqa: E402

H200_BF16_PEAK = 989e12
"""Dense bf16 FLOP/s of an H100/H200 SXM (datasheet), the MFU denominator."""
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


def _qkv(b, s, h, hkv, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=gen).to(device, dtype)
            for n in (h, hkv, hkv)] + [torch.randn(b, s, h, d, generator=gen).to(device, dtype)]


def _error_over_tolerance(pairs, tol: float) -> float:
    """Largest |got - want| - tol * |want| over the pairs, in units of tol (<= 1 passes)."""
    worst = 0.0
    for got, want in pairs:
        err = (got.double() - want).abs() - tol * want.abs()
        worst = max(worst, float(err.max()) / tol)
    return worst


def _against_reference(ctx, backend, qb, kb, q, k, v, dout, causal, tol) -> float:
    """Error of one backend's (out, dq, dk, dv) against the float64 reference, over tol."""
    scale = q.shape[-1] ** -0.5
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, qb, kb, causal, scale)
    ref_out.backward(dout.double())
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = local_attention(*ins, qb, kb, causal=causal, scale=scale,
                             options=KernelOptions(backend=backend))
    out.backward(dout)
    return _error_over_tolerance([(out, ref_out)] + [(a.grad, b.grad) for a, b in
                                                     zip(ins, ref_in)], tol)


def _deterministic_backward(ctx: Context) -> bool:
    """The torch backend's backward with train.deterministic twice: bit for bit the same."""
    q, k, v, dout = _qkv(2, 256 if ctx.dry_run else 4096, 8, 2, 64, ctx.dtype, ctx.device)
    block, grads = Block(torch.arange(q.shape[1])), []
    for _ in range(2):
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        out, _ = local_attention(*ins, block, block, causal=True, scale=0.125,
                                 options=KernelOptions("torch", deterministic=True))
        out.backward(dout)
        grads.append([x.grad for x in ins])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def check_kernels(ctx: Context) -> dict:
    s = 64 if ctx.dry_run else 2048
    rows = []
    for backend in ctx.backends:
        for (h, hkv), causal, docs in [
                ((8, 8), True, None), ((8, 2), True, None), ((8, 1), False, None),
                ((8, 8), True, [s // 8, s // 2, s - s // 8 - s // 2]),
                ((8, 2), False, [s // 8, s // 2, s - s // 8 - s // 2]), ((8, 1), True, [5, s - 5])]:
            q, k, v, dout = _qkv(2, s, h, hkv, 64, ctx.dtype, ctx.device)
            doc = None
            if docs:
                ids = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
                doc = torch.stack([ids, ids.roll(7)])
            block = Block(torch.arange(s), doc)
            tol = ctx.tol(gqa=hkv < h)
            worst = _against_reference(ctx, backend, block, block, q, k, v, dout, causal, tol)
            rows.append({"backend": backend, "heads": f"{h}/{hkv}", "causal": causal,
                         "documents": bool(docs), "tolerance": tol,
                         "error_over_tolerance": round(worst, 3)})
    deterministic = _deterministic_backward(ctx)
    ok = all(r["error_over_tolerance"] <= 1 for r in rows) and deterministic
    worst = {b: max(r["error_over_tolerance"] for r in rows if r["backend"] == b)
             for b in ctx.backends}
    missing = "" if ctx.dry_run or flash_attn_installed() else "; flash_attn not installed"
    return {"status": "PASS" if ok else "FAIL", "cases": rows, "deterministic": deterministic,
            "detail": f"{len(rows)} cases; worst error / tolerance {worst}; torch deterministic "
                      f"backward bit-identical: {deterministic}{missing}"}


CP_CASES = [(name, ranks, ulysses) for ranks in (2, 4)
            for name, ulysses in algorithm_layouts(ranks)]
"""(algorithm, ranks, Ulysses degree): every registered algorithm on 2 and 4 ranks at each
Ulysses degree the layout search tries (USP: 2 on 4 ranks)."""


def _cp_rank(algorithm: str, ulysses: int, dry_run: bool) -> float:
    """One rank of a context-parallel case on the shared device; returns its worst error."""
    from lctrain.layout.topology import Topology
    from lctrain.parallel.runtime import build_mesh, cp_groups

    ctx = Context(dry_run, True)
    if dry_run:
        register_cpu_flash_ops()
    else:
        torch.cuda.set_device(0)
    world = dist.get_world_size()
    topo = Topology(cp_ring=world // ulysses, cp_ulysses=ulysses)
    groups = cp_groups(topo, build_mesh(topo, "cpu"), dist.get_rank())
    s = 16 * world if dry_run else 1024 * world
    lengths = [5, s // 2 - 2, s - s // 2 - 3]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    docs = torch.stack([ids, ids.roll(3)])
    q, k, v, dout = _qkv(2, s, 2 * world, world, 64, ctx.dtype, ctx.device)
    full = Block(torch.arange(s), docs)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, full, full, True, 64 ** -0.5)
    ref_out.backward(dout.double())

    def local(x):
        return sequence.split(x, 1, groups.cp_rank, groups.cp_size, "zigzag")

    ins = [local(x).detach().requires_grad_() for x in (q, k, v)]
    attn = ContextParallelAttention(algorithm, groups, s, "zigzag", options=ctx.kernel)
    with check_collective_devices():
        out = attn(*ins, docs)
        out.backward(local(dout))
    pairs = [(out, local(ref_out))] + [(a.grad, local(b.grad)) for a, b in zip(ins, ref_in)]
    return _error_over_tolerance(pairs, ctx.tol(gqa=True))


def check_cp_algorithms(ctx: Context) -> dict:
    rows = []
    for algorithm, world, ulysses in CP_CASES:
        worst = max(run_ranks(_cp_rank, world, (algorithm, ulysses, ctx.dry_run),
                              start_method="fork" if ctx.dry_run else "spawn",
                              backend="gloo", timeout_s=120))
        rows.append({"algorithm": algorithm, "ranks": world, "ulysses": ulysses,
                     "error_over_tolerance": round(worst, 3)})
    ok = all(r["error_over_tolerance"] <= 1 for r in rows)
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": "worst error / tolerance: " + ", ".join(
                f"{r['algorithm']} x{r['ranks']} {r['error_over_tolerance']:.2f}" for r in rows)}


def _tiny_cfg(steps: int, device: str, dtype: str) -> LctrainConfig:
    cfg = LctrainConfig()
    cfg.model = ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=256)
    cfg.train.steps, cfg.train.seq_len, cfg.train.global_batch = steps, 256, 2
    cfg.train.micro_batch, cfg.train.device, cfg.train.dtype = 2, device, dtype
    cfg.data.source, cfg.data.document_masking = "passkey", True
    cfg.optim.warmup_steps, cfg.logging.progress = 2, False
    return cfg


def _device_dtype(ctx: Context) -> str:
    return "fp32" if ctx.dry_run else "bf16"


def _largest_relative_difference(a: list[dict], b: list[dict]) -> float:
    return max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))


def check_train_tiny(ctx: Context, run_root: Path) -> dict:
    steps = 3 if ctx.dry_run else 20
    cpu = loop.train(_tiny_cfg(steps, "cpu", "fp32"), run_root / "cpu")
    dev = loop.train(_tiny_cfg(steps, ctx.device.type, _device_dtype(ctx)), run_root / "device")
    diff = _largest_relative_difference(cpu, dev)
    tolerance = 1e-5 if ctx.dry_run else 0.03
    return {"status": "PASS" if diff <= tolerance else "FAIL",
            "losses_cpu": [round(h["loss"], 4) for h in cpu],
            "losses_device": [round(h["loss"], 4) for h in dev],
            "detail": f"{steps} steps, largest relative loss difference {diff:.4f} "
                      f"(tolerance {tolerance})"}


def measure_block_activations(cfg: LctrainConfig, batch: int) -> float:
    """Bytes one block keeps for the backward, measured with one forward of `cfg`'s model on
    one process: the last block's (the first also plans what every block shares)."""
    model, run_forward = build_measured_model(cfg, batch)
    return measure_activations(model, run_forward)[list(unwrap(model).layers)[-1]]


def check_selective_memory(ctx: Context) -> dict:
    rows = []
    for mode in ("none", "selective", "full"):
        cfg = _tiny_cfg(1, ctx.device.type, "fp32")
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
        cfg = _tiny_cfg(1, ctx.device.type, _device_dtype(ctx))
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


def check_compile(ctx: Context, run_root: Path) -> dict:
    """torch.compile of the blocks and the loss head: the eager run's losses. A dry run compiles
    with dynamo's aot_eager backend (tracing and the compiled autograd graph, no code
    generation: inductor's C++ build takes over a minute on a small CPU)."""
    if ctx.dry_run:
        eager_compile = torch.nn.Module.compile
        torch.nn.Module.compile = lambda self, **kw: eager_compile(self, backend="aot_eager")
    histories, seconds = {}, {}
    for compiled in (False, True):
        cfg = _tiny_cfg(3, ctx.device.type, _device_dtype(ctx))
        cfg.train.compile = compiled
        if ctx.dry_run:
            cfg.model.n_layers, cfg.train.seq_len = 1, 64
        t0 = time.perf_counter()
        histories[compiled] = loop.train(cfg, run_root / f"compile-{compiled}")
        seconds[compiled] = time.perf_counter() - t0
    diff = _largest_relative_difference(histories[False], histories[True])
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
        cfg = _tiny_cfg(4, ctx.device.type, _device_dtype(ctx))
        cfg.train.deterministic = not ctx.dry_run
        cfg.checkpoint.every, cfg.checkpoint.keep = 2, 0
        cfg.checkpoint.load = load and str(load)
        return cfg

    whole = loop.train(cfg_for(), run_root / "whole")
    saved = run_root / "whole" / "checkpoints" / "step-00000002"
    resumed = loop.train(cfg_for(saved), run_root / "resumed")
    steps = [h["step"] for h in resumed]
    diff = _largest_relative_difference(whole[-2:], resumed[-2:])
    tolerance = 1e-6 if ctx.dry_run else 1e-3
    ok = steps == [3, 4] and diff <= tolerance
    return {"status": "PASS" if ok else "FAIL", "resumed_steps": steps,
            "detail": f"resumed at step {steps[0] if steps else None}; steps 3-4 loss vs the "
                      f"uninterrupted run: largest relative difference {diff:.2e} "
                      f"(tolerance {tolerance})"}


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
    losses = [loop.train_step(model, optimizer, scheduler, loader.next_step(), cfg, rt)["loss"]
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
        cfg = _tiny_cfg(3, ctx.device.type, "fp32")
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
    cfg.train.device, cfg.train.dtype = ctx.device.type, _device_dtype(ctx)
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


def causal_attention_flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
    """FLOPs of one causal attention forward + backward, the convention flash-attention's
    benchmarks use: the forward's two matmuls (QK^T, PV) are 4 S^2 H d, halved by the mask; the
    backward's five matmuls are 2.5 times that (recomputing QK^T included)."""
    forward = 4 * batch * seq**2 * heads * head_dim / 2
    return 3.5 * forward


def _timed(fn, ctx: Context, reps: int) -> float:
    fn()
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    ctx.sync()
    return (time.perf_counter() - t0) / reps


def _matmul_rate(ctx: Context) -> float:
    """The device's measured bf16 matmul FLOP/s (fp32 on the CPU): n x n x n products."""
    n = 256 if ctx.dry_run else 8192
    a, b = (torch.randn(n, n, device=ctx.device, dtype=ctx.dtype) for _ in range(2))
    return 2 * n**3 / _timed(lambda: a @ b, ctx, 3 if ctx.dry_run else 20)


def _bare(backend: str):
    """One causal attention fwd + bwd straight through the backend's op (no lctrain code)."""
    if backend == "torch":
        def run(q, k, v, dout):
            out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False,
                scale=q.shape[-1] ** -0.5)
            torch.ops.aten._flash_attention_backward(
                dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, True,
                torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device),
                scale=q.shape[-1] ** -0.5)
        return run
    if backend == "flash_attn":
        from flash_attn import flash_attn_func  # optional extra: only listed when installed

        def run(q, k, v, dout):
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            flash_attn_func(q, k, v, causal=True).backward(dout)
        return run

    def run(q, k, v, dout):  # cpu: PyTorch's SDPA on the CPU
        q, k, v = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True).backward(dout.transpose(1, 2))
    return run


def check_kernel_throughput(ctx: Context) -> dict:
    """Causal attention fwd + bwd TFLOP/s per backend through lctrain's kernel layer and straight
    through the backend's op, at 8K / 32K / 128K tokens, against the device's matmul rate."""
    matmul = _matmul_rate(ctx)
    if ctx.dry_run:
        lengths, reps, backends = [256], 2, ["torch", "cpu"]
    else:
        lengths = [8192, 32768] if ctx.quick else [8192, 32768, 131072]
        reps, backends = 3, ctx.backends
    rows = []
    for backend in backends:
        for s in lengths:
            q, k, v, dout = _qkv(1, s, 32, 8, 128, ctx.dtype, ctx.device)
            flops = causal_attention_flops(1, s, 32, 128)
            block = Block(torch.arange(s))
            ins = [x.requires_grad_() for x in (q, k, v)]

            def ours(ins=ins, dout=dout, block=block, backend=backend):
                local_attention(*ins, block, block, causal=True, scale=128 ** -0.5,
                                options=KernelOptions(backend=backend))[0].backward(dout)

            bare = _bare(backend)

            def theirs(q=q, k=k, v=v, dout=dout, bare=bare):
                bare(q, k, v, dout)

            t_ours, t_bare = _timed(ours, ctx, reps), _timed(theirs, ctx, reps)
            rows.append({"backend": backend, "seq": s, "lctrain_tflops": flops / t_ours / 1e12,
                         "bare_tflops": flops / t_bare / 1e12,
                         "of_matmul": round(flops / t_ours / matmul, 3),
                         "overhead": round(t_ours / t_bare - 1, 4)})
    # a wrapper more than 10% slower than its own kernel at 32K+ is a defect, not noise
    ok = ctx.dry_run or all(r["overhead"] <= 0.10 for r in rows if r["seq"] >= 32768)
    return {"status": "PASS" if ok else "FAIL", "matmul_tflops": round(matmul / 1e12, 1),
            "cases": rows, "detail": f"matmul {matmul / 1e12:.1f} TFLOP/s; " + ", ".join(
                f"{r['backend']} {r['seq']:,} {r['lctrain_tflops']:.3g} TFLOP/s "
                f"({r['of_matmul']:.2f} of matmul, {100 * r['overhead']:+.1f}% vs bare)"
                for r in rows)}


def check_moe_grouped_mm(ctx: Context) -> dict:
    """A mixture of experts' experts through torch's grouped matmul (the CUDA bf16 path, the
    one expert by expert elsewhere) against one matmul per expert, with an empty expert: the
    outputs and, on CUDA, every gradient. (A dry run compares the forwards: torch's CPU
    grouped matmul has no backward here.)"""
    gen = torch.Generator().manual_seed(0)
    e, d, f = 4, 64, 96
    counts = torch.tensor([40, 0, 56, 32])
    xs = torch.randn(int(counts.sum()), d, generator=gen).to(ctx.device, ctx.dtype)
    ws = [(torch.randn(e, f, d, generator=gen) / d**0.5).to(ctx.device, ctx.dtype)
          for _ in range(2)] + [(torch.randn(e, d, f, generator=gen) / f**0.5).to(
              ctx.device, ctx.dtype)]
    results = []
    for splits in (None, counts.tolist()):  # grouped, then expert by expert
        leaves = [t.clone().requires_grad_(not ctx.dry_run) for t in (xs, *ws)]
        gate = torch.nn.functional.silu(grouped_matmul(leaves[0], leaves[1].transpose(-2, -1),
                                                       counts.to(ctx.device), splits))
        up = grouped_matmul(leaves[0], leaves[2].transpose(-2, -1), counts.to(ctx.device), splits)
        out = grouped_matmul(gate * up, leaves[3].transpose(-2, -1), counts.to(ctx.device),
                             splits)
        if not ctx.dry_run:
            out.float().square().sum().backward()
        results.append([out] + ([] if ctx.dry_run else [t.grad for t in leaves]))
    worst = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                for a, b in zip(*results))
    tol = 1e-5 if ctx.dry_run else BF16_TOL
    return {"status": "PASS" if worst <= tol else "FAIL", "max_rel_diff": worst,
            "detail": f"largest difference / largest value {worst:.2e} (tolerance {tol:.0e}), "
                      + ("forward" if ctx.dry_run else "forward and every gradient")}


def check_batch_transfer(ctx: Context) -> dict:
    tokens = torch.randint(1, 100, (2, 65))
    lengths = [torch.tensor([30, 35]).numpy()] * 2
    mb = micro_batch_from_tokens(tokens, 64, lengths=lengths, document_masking=True)
    moved = mb.to(ctx.device)
    ok = (moved.inputs.device.type == ctx.device.type and moved.doc_ids is mb.doc_ids
          and torch.equal(moved.inputs.cpu(), mb.inputs))
    return {"status": "PASS" if ok else "FAIL",
            "detail": f"inputs on {moved.inputs.device}, document ids stay on the host"}


@dataclass(frozen=True)
class Check:
    fn: object
    expected_s: float
    """Seconds it takes on an H200 (not started when less of the budget is left)."""
    limit_s: float
    """Seconds after which it is stopped and FAILs."""
    needs_run_dir: bool = False


CHECKS = {  # in order of what a first GPU run must not miss
    "env": Check(check_env, 10, 60),
    "kernels": Check(check_kernels, 25, 120),
    "cp_algorithms": Check(check_cp_algorithms, 60, 150),
    "train_tiny": Check(check_train_tiny, 25, 90, True),
    "step_8b": Check(check_step_8b, 60, 180, True),
    "kernel_throughput": Check(check_kernel_throughput, 40, 120),
    "checkpoint_resume": Check(check_checkpoint_resume, 25, 90, True),
    "selective_memory": Check(check_selective_memory, 15, 60),
    "offload_and_tiling": Check(check_offload_and_tiling, 20, 90),
    "state_offload": Check(check_state_offload, 20, 90),
    "compile": Check(check_compile, 60, 150, True),
    "batch_transfer": Check(check_batch_transfer, 10, 60),
    "moe_grouped_mm": Check(check_moe_grouped_mm, 10, 60),
}


def _run_check(name: str, ctx: Context, run_root: Path) -> dict:
    """One check, in its own process (see `run`)."""
    if ctx.dry_run:
        register_cpu_flash_ops()
    setup_distributed(_tiny_cfg(1, ctx.device.type, "fp32"))  # device selection, one process
    check = CHECKS[name]
    return check.fn(ctx, run_root / name) if check.needs_run_dir else check.fn(ctx)


def _write(path: Path, results: list[dict], summary: dict) -> None:
    """The JSON so far, replaced whole (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"summary": summary, "checks": results}, indent=1, default=str))
    os.replace(tmp, path)


def run(ctx: Context, run_root: Path, out: Path, budget_s: float,
        only: list[str] | None = None) -> list[dict]:
    """Every check in its own process with its own time limit, while the budget lasts; the JSON
    is rewritten after each."""
    t_start, results = time.monotonic(), []
    threads = 1 if ctx.dry_run else min(8, os.cpu_count() or 1)
    for name, check in CHECKS.items():
        if only and name not in only:
            continue
        left = budget_s - (time.monotonic() - t_start)
        t0 = time.monotonic()
        if left < check.expected_s:
            result = {"status": "SKIP", "detail": f"budget: {left:.0f} s left of {budget_s:g} "
                                                  f"s, it takes about {check.expected_s:g} s"}
        else:
            limit = min(check.limit_s, left)
            try:
                (result,) = run_ranks(_run_check, 1, (name, ctx, run_root),
                                      start_method="fork" if ctx.dry_run else "spawn",
                                      threads=threads, backend=None, timeout_s=limit)
            except RankFailure as e:
                result = {"status": "FAIL", "detail": e.reason[:600]}
        result.update(name=name, seconds=round(time.monotonic() - t0, 1))
        results.append(result)
        _write(out, results, _summary(results, ctx, time.monotonic() - t_start))
        print(f"{result['status']:<5} {name:<20} {result['detail']}", flush=True)
    return results


def _summary(results: list[dict], ctx: Context, seconds: float) -> dict:
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    return {**counts, "seconds": round(seconds, 1), "dry_run": ctx.dry_run}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the wiring, on the CPU")
    ap.add_argument("--quick", action="store_true", help="fewer sequence lengths")
    ap.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks only")
    ap.add_argument("--budget", type=float, default=420,
                    help="seconds; checks that would not fit are not started (default 420)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/lctrain-gpu-check"))
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("tools/gpu_check.py needs a CUDA GPU (or --dry-run on the CPU)", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.dry_run, args.quick)
    t0 = time.monotonic()
    results = run(ctx, args.run_dir, args.out, args.budget, args.only)
    summary = _summary(results, ctx, time.monotonic() - t0)
    print(f"summary: {summary['PASS']} passed, {summary['FAIL']} failed, {summary['SKIP']} "
          f"skipped in {summary['seconds']} s")
    return 1 if summary["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
