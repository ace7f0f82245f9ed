"""Check lctrain's CUDA path on one GPU: prints PASS / FAIL / SKIP per check and a summary, and
writes every result as JSON.

    python tools/gpu_check.py [--out gpu_check.json] [--quick]   # on a GPU, about 5 minutes
    python tools/gpu_check.py --dry-run                          # on the CPU: the wiring only

Checks: the environment; flash-attn through lctrain's kernel layer against a float64 reference
(dense and packed documents via varlen, causal or not, MHA / GQA / MQA, bf16 tolerances); every
context-parallel algorithm on ranks sharing the GPU (gloo with CUDA tensors; any op gloo cannot
run on CUDA is reported as SKIP), with every collective's tensors checked against its group's
device; the tiny model trained 20 steps on CUDA in bf16 against the CPU in fp32; selective
checkpointing's activation bytes on CUDA against the formula; activation offload and the tiled
loss and MLP (gradients as the plain path's, less device memory); lctrain's attention against a
bare flash-attn call (goal: at most 5% slower); one training step of a Llama-3-8B-shaped model
with 2 layers at 64K tokens (tokens/s, MFU, and beside them the step time and memory
`lctrain plan` predicts for that run); and the host-to-device batch copy.

--dry-run runs the same code on the CPU with tiny sizes and the plain-torch varlen kernel in
place of flash-attn, so that a change that breaks the script shows before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lctrain.attention import ContextParallelAttention  # noqa: E402
from lctrain.attention.calls import Block  # noqa: E402
from lctrain.attention.kernels import KernelOptions, reference_attention  # noqa: E402
from lctrain.attention.local import local_attention  # noqa: E402
from lctrain.config import LctrainConfig, ModelConfig  # noqa: E402
from lctrain.data.batch import micro_batch_from_tokens  # noqa: E402
from lctrain.layout import sequence  # noqa: E402
from lctrain.layout.comm import check_collective_devices  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.parallel.memory import (  # noqa: E402
    build_measured_model,
    measure_block_activations,
)
from lctrain.parallel.runtime import setup_distributed  # noqa: E402
from lctrain.planning.memory import activation_formula  # noqa: E402
from lctrain.planning.plan import rank_memory  # noqa: E402
from lctrain.planning.timing import hardware_for, predict_step_time  # noqa: E402
from lctrain.training import loop  # noqa: E402

H200_BF16_PEAK = 989e12
"""Dense bf16 FLOP/s of an H100/H200 SXM, the MFU denominator."""


@dataclass
class Context:
    device: torch.device
    dry_run: bool
    quick: bool
    results: list[dict] = field(default_factory=list)

    @property
    def kernel(self) -> KernelOptions:
        """flash-attn on the GPU; the plain-torch varlen kernel in a dry run."""
        return KernelOptions(backend="reference" if self.dry_run else "flash")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.dry_run else torch.bfloat16

    @property
    def tol(self) -> dict:
        return {"rtol": 1e-4, "atol": 1e-4} if self.dry_run else {"rtol": 2e-2, "atol": 2e-2}


def check_env(ctx: Context) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        import flash_attn  # optional extra

        info["flash_attn"] = flash_attn.__version__
    except ImportError:
        info["flash_attn"] = None
    if ctx.device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())),
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        if info["flash_attn"] is None:
            return {"status": "FAIL", "detail": "flash-attn is not installed", **info}
    return {"status": "PASS", "detail": ", ".join(f"{k} {v}" for k, v in info.items()), **info}


def _qkv(b, s, h, hkv, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=gen).to(device, dtype)
            for n in (h, hkv, hkv)] + [torch.randn(b, s, h, d, generator=gen).to(device, dtype)]


def _against_reference(ctx, qb, kb, q, k, v, dout, causal) -> float:
    """Largest error of lctrain's kernels (out, dq, dk, dv) against the float64 reference,
    relative to the tolerance (<= 1 passes)."""
    scale = q.shape[-1] ** -0.5
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, qb, kb, causal, scale)
    ref_out.backward(dout.double())
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = local_attention(*ins, qb, kb, causal=causal, scale=scale, options=ctx.kernel)
    out.backward(dout)
    worst = 0.0
    for got, want in [(out, ref_out)] + [(a.grad, b.grad) for a, b in zip(ins, ref_in)]:
        err = (got.double() - want).abs() - ctx.tol["rtol"] * want.abs()
        worst = max(worst, float(err.max()) / ctx.tol["atol"])
    return worst


def check_kernels(ctx: Context) -> dict:
    s = 64 if ctx.dry_run else 2048
    rows = []
    for (h, hkv), causal, docs in [((8, 8), True, None), ((8, 2), True, None), ((8, 1), False, None),
                                   ((8, 2), True, [s // 8, s // 2, s - s // 8 - s // 2]),
                                   ((8, 1), True, [5, s - 5])]:
        q, k, v, dout = _qkv(2, s, h, hkv, 64, ctx.dtype, ctx.device)
        doc = None
        if docs:
            ids = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
            doc = torch.stack([ids, ids.roll(7)])
        block = Block(torch.arange(s), doc)
        worst = _against_reference(ctx, block, block, q, k, v, dout, causal)
        rows.append({"heads": f"{h}/{hkv}", "causal": causal, "documents": bool(docs),
                     "error_over_tolerance": round(worst, 3)})
    ok = all(r["error_over_tolerance"] <= 1 for r in rows)
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": f"{len(rows)} cases, worst error {max(r['error_over_tolerance'] for r in rows):.2f}"
                      f" x tolerance ({ctx.tol})"}


def _cp_rank(algorithm: str, ulysses: int, dry_run: bool) -> float:
    """One rank of a context-parallel case on the shared device; returns its worst error."""
    from lctrain.layout.topology import Topology
    from lctrain.parallel.runtime import build_mesh, cp_groups

    ctx = Context(torch.device("cpu" if dry_run else "cuda", 0), dry_run, True)
    world = dist.get_world_size()
    topo = Topology(cp_ring=world // ulysses, cp_ulysses=ulysses)
    groups = cp_groups(topo, build_mesh(topo, "cpu"), dist.get_rank())
    s, lengths = 16 * world, [5, 8 * world - 2, 8 * world - 3]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    docs = torch.stack([ids, ids.roll(3)])
    q, k, v, dout = _qkv(2, s, 2 * world, world, 64, ctx.dtype, ctx.device)
    full = Block(torch.arange(s), docs)
    scale = 64 ** -0.5
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, full, full, True, scale)
    ref_out.backward(dout.double())

    def local(x):
        return sequence.split(x, 1, groups.cp_rank, groups.cp_size, "zigzag")

    ins = [local(x).detach().requires_grad_() for x in (q, k, v)]
    attn = ContextParallelAttention(algorithm, groups, s, "zigzag", options=ctx.kernel)
    with check_collective_devices():
        out = attn(*ins, docs)
        out.backward(local(dout))
    worst = 0.0
    for got, want in [(out, local(ref_out))] + [(a.grad, local(b.grad)) for a, b in zip(ins, ref_in)]:
        err = (got.double() - want).abs() - ctx.tol["rtol"] * want.abs()
        worst = max(worst, float(err.max()) / ctx.tol["atol"])
    return worst


def check_cp_algorithms(ctx: Context) -> dict:
    rows, skipped = [], []
    for algorithm, world, ulysses in [("ring", 2, 1), ("ulysses", 2, 2), ("allgather", 2, 1),
                                      ("usp", 4, 2)]:
        try:
            worst = max(run_ranks(_cp_rank, world, (algorithm, ulysses, ctx.dry_run),
                                  start_method="fork" if ctx.dry_run else "spawn",
                                  backend="gloo", timeout_s=300))
            rows.append({"algorithm": algorithm, "ranks": world, "error_over_tolerance":
                         round(worst, 3)})
        except Exception as e:  # noqa: BLE001 (gloo without CUDA support for an op: report it)
            skipped.append(f"{algorithm}: {type(e).__name__}: {str(e)[:200]}")
    if not rows:
        return {"status": "SKIP", "detail": "; ".join(skipped)}
    ok = all(r["error_over_tolerance"] <= 1 for r in rows)
    detail = ", ".join(f"{r['algorithm']} {r['error_over_tolerance']:.2f}" for r in rows)
    return {"status": "PASS" if ok and not skipped else ("FAIL" if not ok else "SKIP"),
            "cases": rows, "skipped": skipped,
            "detail": f"worst error / tolerance: {detail}" + (f"; skipped {skipped}" if skipped
                                                                else "")}


def _tiny_cfg(steps: int, device: str, dtype: str) -> LctrainConfig:
    cfg = LctrainConfig()
    cfg.model = ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=256)
    cfg.train.steps, cfg.train.seq_len, cfg.train.global_batch = steps, 256, 2
    cfg.train.micro_batch, cfg.train.device, cfg.train.dtype = 2, device, dtype
    cfg.data.source, cfg.data.document_masking = "passkey", True
    cfg.optim.warmup_steps, cfg.logging.progress = 2, False
    return cfg


def check_train_tiny(ctx: Context, run_root: Path) -> dict:
    steps = 3 if ctx.dry_run else 20
    cpu = loop.train(_tiny_cfg(steps, "cpu", "fp32"), run_root / "cpu")
    dev = loop.train(_tiny_cfg(steps, ctx.device.type, "fp32" if ctx.dry_run else "bf16"),
                     run_root / "device")
    diff = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(cpu, dev))
    tolerance = 1e-5 if ctx.dry_run else 0.03
    return {"status": "PASS" if diff <= tolerance else "FAIL",
            "losses_cpu": [round(h["loss"], 4) for h in cpu],
            "losses_device": [round(h["loss"], 4) for h in dev],
            "detail": f"{steps} steps, largest relative loss difference {diff:.4f} "
                      f"(tolerance {tolerance})"}


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
    """Offload, the tiled loss and the tiled MLP on the device: the same gradients as the plain
    path (offload bit for bit), and less device memory: offload keeps almost nothing on the
    device between forward and backward, the tilings lower the peak."""
    seq = 256 if ctx.dry_run else 8192
    variants = {"plain": {}, "offload": {"offload_activations": True},
                "loss_chunk": {"loss_chunk": seq // 8}, "mlp_chunk": {"mlp_chunk": seq // 8}}
    runs = {}
    for name, keys in variants.items():
        cfg = _tiny_cfg(1, ctx.device.type, "fp32" if ctx.dry_run else "bf16")
        cfg.train.seq_len, cfg.train.activation_checkpointing = seq, "full"
        for key, value in keys.items():
            setattr(cfg.train, key, value)
        runs[name] = _forward_backward_memory(cfg, ctx.device)
    plain = runs["plain"]
    rows, ok = [], True
    for name, got in runs.items():
        worst = max(float((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-12))
                    for n, g in plain["grads"].items())
        tolerance = 0.0 if name == "offload" else (1e-5 if ctx.dry_run else 2e-2)
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


def _timed(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def check_wrapper_overhead(ctx: Context) -> dict:
    if ctx.dry_run:
        def bare(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
        lengths, reps = [256], 2
    else:
        from flash_attn import flash_attn_func  # optional extra, checked by check_env

        def bare(q, k, v):
            return flash_attn_func(q, k, v, causal=True)
        lengths, reps = ([8192, 32768] if ctx.quick else [8192, 32768, 131072]), 5
    rows = []
    for s in lengths:
        q, k, v, dout = _qkv(1, s, 32, 8, 128, ctx.dtype, ctx.device)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        block = Block(torch.arange(s))

        def ours(q=q, k=k, v=v, dout=dout, block=block):
            local_attention(q, k, v, block, block, causal=True, scale=128 ** -0.5,
                            options=KernelOptions(backend="cpu" if ctx.dry_run else "flash")
                            )[0].backward(dout)

        def theirs(q=q, k=k, v=v, dout=dout):
            bare(q, k, v).backward(dout)

        t_ours, t_bare = _timed(ours, ctx.device, reps), _timed(theirs, ctx.device, reps)
        rows.append({"seq": s, "lctrain_ms": round(1e3 * t_ours, 3),
                     "bare_ms": round(1e3 * t_bare, 3), "overhead": round(t_ours / t_bare - 1, 4)})
    ok = ctx.dry_run or all(r["overhead"] <= 0.05 for r in rows)
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": ", ".join(f"{r['seq']}: {100 * r['overhead']:+.1f}%" for r in rows) +
                      " (causal fwd+bwd, lctrain / bare - 1; goal <= +5%)"}


def llama8b_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters, output layer included) for forward and
    backward, plus causal attention 6 x n_layers x seq_len x dim (QK^T and PV, 2 FLOPs per
    multiply-add, halved by the causal mask, times 3 for forward + backward)."""
    head_dim = m.dim // m.n_heads
    block = m.dim * head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.dim * m.ffn_dim
    matmuls = m.n_layers * block + m.vocab_size * m.dim
    return 6 * matmuls + 6 * m.n_layers * seq_len * m.dim


def check_step_8b(ctx: Context, run_root: Path) -> dict:
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
    cfg.train.device, cfg.train.dtype = ctx.device.type, "fp32" if ctx.dry_run else "bf16"
    cfg.train.activation_checkpointing = "full"
    cfg.optim.warmup_steps, cfg.logging.progress = 1, False
    errors = []
    for s in seq_lens:
        cfg.train.seq_len = s
        try:
            history = loop.train(cfg, run_root / f"step-{s}")
        except torch.OutOfMemoryError as e:
            errors.append(f"seq {s}: out of memory ({str(e)[:120]})")
            torch.cuda.empty_cache()
            continue
        seconds = history[-1]["step_time"]  # the second step: the first compiles and warms up
        tokens_per_s = s / seconds
        mfu = tokens_per_s * llama8b_flops_per_token(cfg.model, s) / H200_BF16_PEAK
        peak = torch.cuda.max_memory_allocated() / 2**30 if ctx.device.type == "cuda" else None
        # what `lctrain plan` predicts for this very run (plan.* H100 defaults on the GPU)
        planned_s = predict_step_time(cfg, 1, hardware_for(
            cfg, gpu_available=ctx.device.type == "cuda")).total_s
        modelled = rank_memory(cfg, 1, 0)["itemised"]["bytes"]["modelled"] / 2**30
        return {"status": "PASS", "seq_len": s, "tokens_per_s": round(tokens_per_s, 1),
                "mfu": round(mfu, 4), "peak_gib": peak and round(peak, 1), "errors": errors,
                "plan_step_s": float(f"{planned_s:.4g}"), "step_s": float(f"{seconds:.4g}"),
                "plan_over_measured_time": float(f"{planned_s / seconds:.3g}"),
                "plan_modelled_gib": float(f"{modelled:.4g}"),
                "plan_over_measured_memory": peak and float(f"{modelled / peak:.3g}"),
                "detail": f"seq {s}: {tokens_per_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% "
                          f"(of {H200_BF16_PEAK / 1e12:.0f} TFLOP/s)"
                          + (f", peak {peak:.1f} GiB" if peak else "")
                          + f"; lctrain plan: {planned_s:.4g} s per step "
                          f"({planned_s / seconds:.2f} x measured), {modelled:.4g} GiB modelled"}
    return {"status": "FAIL", "detail": "; ".join(errors), "errors": errors}


def check_batch_transfer(ctx: Context) -> dict:
    tokens = torch.randint(1, 100, (2, 65))
    lengths = [torch.tensor([30, 35]).numpy()] * 2
    mb = micro_batch_from_tokens(tokens, 64, lengths=lengths, document_masking=True)
    moved = mb.to(ctx.device)
    ok = (moved.inputs.device.type == ctx.device.type and moved.doc_ids is mb.doc_ids
          and torch.equal(moved.inputs.cpu(), mb.inputs))
    return {"status": "PASS" if ok else "FAIL",
            "detail": f"inputs on {moved.inputs.device}, document ids stay on the host"}


CHECKS = {"env": check_env, "kernels": check_kernels, "cp_algorithms": check_cp_algorithms,
          "train_tiny": check_train_tiny, "selective_memory": check_selective_memory,
          "offload_and_tiling": check_offload_and_tiling,
          "wrapper_overhead": check_wrapper_overhead, "step_8b": check_step_8b,
          "batch_transfer": check_batch_transfer}


def run(ctx: Context, run_root: Path, only: list[str] | None = None) -> list[dict]:
    setup_distributed(_tiny_cfg(1, ctx.device.type, "fp32"))  # device selection, one process
    for name, fn in CHECKS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            needs_dir = fn.__code__.co_argcount == 2
            result = fn(ctx, run_root) if needs_dir else fn(ctx)
        except Exception as e:  # noqa: BLE001 (a failing check must not stop the others)
            result = {"status": "FAIL", "detail": f"{type(e).__name__}: {str(e)[:300]}",
                      "traceback": traceback.format_exc()[-2000:]}
        result.update(name=name, seconds=round(time.perf_counter() - t0, 1))
        ctx.results.append(result)
        print(f"{result['status']:<5} {name:<20} {result['detail']}", flush=True)
    return ctx.results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the wiring, on the CPU")
    ap.add_argument("--quick", action="store_true", help="fewer sequence lengths")
    ap.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks only")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/lctrain-gpu-check"))
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("tools/gpu_check.py needs a CUDA GPU (or --dry-run on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    ctx = Context(device, args.dry_run, args.quick)
    t0 = time.perf_counter()
    results = run(ctx, args.run_dir, args.only)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    summary = {**counts, "seconds": round(time.perf_counter() - t0, 1), "dry_run": args.dry_run}
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {summary['seconds']} s")
    args.out.write_text(json.dumps({"summary": summary, "checks": results}, indent=1,
                                   default=str))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
