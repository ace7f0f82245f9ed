"""The attention kernels checked: every backend against float64 (dense and packed documents,
causal or not, MHA / GQA / MQA) with the torch backend's deterministic backward; their
throughput in TFLOP/s against the device's bf16 matmul rate; MoE's grouped matmul.
"""

from __future__ import annotations

import torch

from gpu_checks.context import (
    BF16_TOL,
    Context,
    error_over_tolerance,
    qkv,
    timed,
)
from lctrain.attention.calls import Block
from lctrain.attention.cuda_kernels import flash_attn_installed
from lctrain.attention.delta_fla import fla_gated_delta_rule, fla_installed
from lctrain.attention.delta_rule import chunk_gated_delta_rule
from lctrain.attention.kernels import KernelOptions
from lctrain.attention.local import local_attention
from lctrain.models.moe import grouped_matmul
from tests.reference import reference_attention


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
    return error_over_tolerance([(out, ref_out)] + [(a.grad, b.grad) for a, b in
                                                     zip(ins, ref_in)], tol)


def _deterministic_backward(ctx: Context) -> bool:
    """The torch backend's backward with train.deterministic twice: bit for bit the same."""
    q, k, v, dout = qkv(2, 256 if ctx.dry_run else 4096, 8, 2, 64, ctx.dtype, ctx.device)
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
            q, k, v, dout = qkv(2, s, h, hkv, 64, ctx.dtype, ctx.device)
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


def causal_attention_flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
    """FLOPs of one causal attention forward + backward, the convention flash-attention's
    benchmarks use: the forward's two matmuls (QK^T, PV) are 4 S^2 H d, halved by the mask; the
    backward's five matmuls are 2.5 times that (recomputing QK^T included)."""
    forward = 4 * batch * seq**2 * heads * head_dim / 2
    return 3.5 * forward


def _matmul_rate(ctx: Context) -> float:
    """The device's measured bf16 matmul FLOP/s (fp32 on the CPU): n x n x n products."""
    n = 256 if ctx.dry_run else 8192
    a, b = (torch.randn(n, n, device=ctx.device, dtype=ctx.dtype) for _ in range(2))
    return 2 * n**3 / timed(lambda: a @ b, ctx, 3 if ctx.dry_run else 20)


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
            q, k, v, dout = qkv(1, s, 32, 8, 128, ctx.dtype, ctx.device)
            flops = causal_attention_flops(1, s, 32, 128)
            block = Block(torch.arange(s))
            ins = [x.requires_grad_() for x in (q, k, v)]

            def ours(ins=ins, dout=dout, block=block, backend=backend):
                local_attention(*ins, block, block, causal=True, scale=128 ** -0.5,
                                options=KernelOptions(backend=backend))[0].backward(dout)

            bare = _bare(backend)

            def theirs(q=q, k=k, v=v, dout=dout, bare=bare):
                bare(q, k, v, dout)

            t_ours, t_bare = timed(ours, ctx, reps), timed(theirs, ctx, reps)
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


def check_linear_rule(ctx: Context) -> dict:
    """The gated delta rule of the linear-attention layers on the device, with packed documents,
    an initial state and the transition state passing needs: lctrain's chunked torch rule in
    the device dtype (float32 inside) and, where flash-linear-attention imports, its kernels
    (train.linear_kernel=fla), each against the chunked rule in float64 on the CPU: outputs,
    final states, transitions and every gradient."""
    gen = torch.Generator().manual_seed(0)
    b, s, h_k, h, d_k, d_v = 2, 200, 2, 4, 64, 64
    qkv = [torch.randn(b, s, n, d, generator=gen, dtype=torch.float64)
           for n, d in ((h_k, d_k), (h_k, d_k), (h, d_v))]
    g = -torch.rand(b, s, h, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(b, s, h, generator=gen, dtype=torch.float64)
    start = torch.randn(b, h, d_k, d_v, generator=gen, dtype=torch.float64) * 0.1
    doc_ids = torch.cat([torch.zeros(s // 2), torch.ones(s - s // 2)]).long().expand(b, s)
    doc_ids = torch.stack([doc_ids[0], torch.zeros(s, dtype=torch.long)])  # row 2: one doc
    weights = None

    def run(rule, dtype, device):
        nonlocal weights
        leaves = [x.to(device, dtype).requires_grad_() for x in (*qkv, g, beta)]
        leaves.append(start.to(device, torch.float32 if dtype != torch.float64 else dtype)
                      .requires_grad_())
        out = rule(*leaves[:5], doc_ids=doc_ids, initial_state=leaves[5], transition=True)
        if weights is None:
            weights = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in out]
        loss = sum((x.double() * w.to(device)).sum() for x, w in zip(out, weights))
        grads = torch.autograd.grad(loss, leaves)
        return [t.detach().double().cpu() for t in (*out, *grads)]

    want = run(chunk_gated_delta_rule, torch.float64, torch.device("cpu"))
    rules = {"torch": chunk_gated_delta_rule}
    if fla_installed() and ctx.device.type == "cuda":
        rules["fla"] = fla_gated_delta_rule
    rows, tol = [], 1e-5 if ctx.dry_run else BF16_TOL
    for name, rule in rules.items():
        got = run(rule, ctx.dtype, ctx.device)
        worst = max(float((a - w).abs().max() / w.abs().max().clamp_min(1e-12))
                    for a, w in zip(got, want))
        rows.append({"rule": name, "max_rel_diff": worst})
    ok = all(r["max_rel_diff"] <= tol for r in rows)
    missing = "" if "fla" in rules else "; flash-linear-attention not installed: fla not run"
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": ", ".join(f"{r['rule']} {r['max_rel_diff']:.2e}" for r in rows)
                      + f" (tolerance {tol:.0e}; largest difference / largest value over "
                      "outputs, states, transitions, gradients)" + missing}
