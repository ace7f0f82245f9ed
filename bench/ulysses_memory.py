"""Ulysses attention memory per rank: lctrain against yunchang's UlyssesAttention, side by side.

    python bench/ulysses_memory.py [--seq 16384] [--heads 8] [--head-dim 128] [--reps 3]

Two gloo ranks on the CPU, fp32, causal, one forward + backward per fresh process (forked), so
that every measurement starts from the same allocator state. Reported: the peak resident memory
above the process's resident memory just before the call (Linux VmHWM after resetting it,
minus VmRSS), in MiB, min / median / max over --reps processes. The inputs (q, k, v and the
output gradient, created before the baseline) are not counted. yunchang runs with its torch
SDPA kernel (F.scaled_dot_product_attention, the CPU flash kernel lctrain calls too) on the
contiguous split (its layout); lctrain on the contiguous split and on zigzag. yunchang is not a dependency: `pip install --no-deps yunchang==0.6.4` to compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.attention import ContextParallelAttention, CPGroups  # noqa: E402
from lctrain.layout import sequence  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402

MIB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _inputs(seq: int, heads: int, head_dim: int, layout: str):
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq, heads, head_dim, generator=gen) for _ in range(4)]
    rank, world = dist.get_rank(), dist.get_world_size()
    return [sequence.split(x, 1, rank, world, layout).contiguous() for x in full]


def _peak_above_baseline(run) -> float:
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    run()
    return (_status("VmHWM") - base) / MIB


def _lctrain(seq: int, heads: int, head_dim: int, layout: str) -> float:
    world = dist.get_world_size()
    groups = CPGroups(cp=dist.group.WORLD, ring=None, ulysses=dist.group.WORLD,
                      ulysses_size=world, ulysses_rank=dist.get_rank())
    attn = ContextParallelAttention("ulysses", groups, seq, layout)
    q, k, v, dout = _inputs(seq, heads, head_dim, layout)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def run():
        attn(q, k, v).backward(dout)

    return _peak_above_baseline(run)


def _sdpa(q, k, v, causal=True, softmax_scale=None, **_):
    """[B, S, H, d] causal attention through PyTorch's SDPA (on the CPU: its flash kernel)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        scale=softmax_scale)
    return out.transpose(1, 2)


def _yunchang(seq: int, heads: int, head_dim: int, layout: str) -> float:
    from yunchang import UlyssesAttention  # optional: the peer measured against
    from yunchang.kernels import AttnType

    attn = UlyssesAttention(dist.group.WORLD, attn_type=AttnType.TORCH_FLASH)
    attn.attn_fn = _sdpa  # its torch kernels' fwd-bwd entry expects a ring group: plain SDPA
    q, k, v, dout = _inputs(seq, heads, head_dim, "none")
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def run():
        attn(q, k, v, causal=True).backward(dout)

    return _peak_above_baseline(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    local = args.seq // 2 * args.heads * args.head_dim * 4 / MIB
    print(f"Ulysses, 2 ranks, S={args.seq}, {args.heads} heads x {args.head_dim}, fp32, causal; "
          f"one local q/k/v/out = {local:.0f} MiB")
    print(f"{'implementation':<24} {'peak above baseline, MiB (min / median / max)':>46}")
    cases = [("lctrain, contiguous", _lctrain, "none"), ("lctrain, zigzag", _lctrain, "zigzag")]
    try:
        import yunchang  # noqa: F401  (optional)

        cases.append(("yunchang 0.6.4", _yunchang, "none"))
    except ImportError:
        print("(yunchang not installed: pip install --no-deps yunchang==0.6.4 to compare)")
    for name, fn, layout in cases:
        peaks = [max(run_ranks(fn, 2, (args.seq, args.heads, args.head_dim, layout),
                               timeout_s=600)) for _ in range(args.reps)]
        print(f"{name:<24} {min(peaks):>18.0f} / {statistics.median(peaks):>6.0f} / "
              f"{max(peaks):>6.0f}", flush=True)


if __name__ == "__main__":
    main()
