"""GPU: flash-attn called directly vs lctrain's block kernels (lctrain.attention.local) on one GPU.

Times causal forward + backward, bf16, and prints TFLOP/s for both and the overhead of lctrain's
wrapper (run decomposition, float32 (out, lse) merge). Needs CUDA and flash-attn
(`pip install 'lctrain[gpu]'`); exits with a clear message otherwise.

    python bench/gpu_attention.py --seq-lens 8192 32768 131072 --heads 32 --kv-heads 8
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.attention.calls import Block  # noqa: E402
from lctrain.attention.local import local_attention  # noqa: E402


def causal_flops(seq: int, heads: int, head_dim: int, batch: int) -> float:
    """Forward + backward FLOPs of causal attention (2 matmuls forward, 5 backward, half masked)."""
    return 7 * 2 * batch * heads * head_dim * seq * seq / 2


def time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _direct(flash_attn_func, q, k, v, scale) -> None:
    flash_attn_func(q, k, v, softmax_scale=scale, causal=True).sum().backward()


def _ours(q, k, v, block, scale) -> None:
    local_attention(q, k, v, block, block, causal=True, scale=scale)[0].sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_attention.py needs a CUDA GPU")
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        sys.exit("bench/gpu_attention.py needs flash-attn: pip install 'lctrain[gpu]'")
    print(f"{torch.cuda.get_device_name()} | heads {args.heads}/{args.kv_heads}, d {args.head_dim},"
          f" batch {args.batch}, bf16, causal fwd+bwd")
    print(f"{'seq':>8} | {'flash-attn TFLOP/s':>18} | {'lctrain TFLOP/s':>15} | {'ratio':>6}")
    for seq in args.seq_lens:
        shape = (args.batch, seq)
        q = torch.randn(*shape, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        k, v = (torch.randn(*shape, args.kv_heads, args.head_dim, device="cuda",
                            dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        block = Block(torch.arange(seq))
        scale = args.head_dim ** -0.5
        direct = partial(_direct, flash_attn_func, q, k, v, scale)
        ours = partial(_ours, q, k, v, block, scale)
        torch.testing.assert_close(
            local_attention(q, k, v, block, block, causal=True, scale=scale)[0],
            flash_attn_func(q, k, v, softmax_scale=scale, causal=True), rtol=2e-2, atol=2e-2)
        flops = causal_flops(seq, args.heads, args.head_dim, args.batch)
        t_direct, t_ours = time_ms(direct), time_ms(ours)
        print(f"{seq:>8} | {flops / t_direct / 1e9:>18.1f} | {flops / t_ours / 1e9:>15.1f} | "
              f"{t_direct / t_ours:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
