"""Context-parallel attention benchmarks on the CPU (gloo ranks, 1 thread each). Prints tables.

    python bench/attention.py                       # every section
    python bench/attention.py --section traffic     # measured / formula elements, P = 2, 4, 8
    python bench/attention.py --section balance     # causal work max/mean per rank
    python bench/attention.py --section efficiency  # t(1 process) / (P * t(P ranks)), P = 2
    python bench/attention.py --section maxlen      # tiny model, cp=8: memory per rank vs length
    python bench/attention.py --section window      # window layer vs full layer: elements sent

traffic: one forward + backward per algorithm under `record_traffic`, divided by the formulas of
lctrain.planning.traffic (docs/parallelism.md §5-8). balance: query-key pairs each rank's
kernels compute (the same run decomposition the kernels execute), contiguous vs zigzag. efficiency: wall time of
one causal forward + backward at a long sequence, single process vs P ranks, each 1 thread.
maxlen: one cp=8 training step of the tiny model per length; peak RSS per rank, a linear fit,
and the length at which 8 ranks would fill the machine's available memory. window: the most
elements any rank sends in one forward + backward of a sliding-window layer (the halo exchange,
docs/parallelism.md §25) and of a full layer, measured by `record_traffic`, zigzag, P = 2, 4, 8,
and the window layer's over 4 (W - 1) d_kv: the chunk boundaries it sends across (K, V and
their gradients of W - 1 tokens each; 1 at P = 2, 2 beyond; USP adds its all-to-alls).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.attention import ContextParallelAttention, CPGroups  # noqa: E402
from lctrain.attention.calls import Block, kernel_calls, pairs_computed  # noqa: E402
from lctrain.attention.local import local_attention  # noqa: E402
from lctrain.comm import record_traffic  # noqa: E402
from lctrain.layout import sequence  # noqa: E402
from lctrain.layout.topology import Topology  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.parallel.runtime import build_mesh, cp_groups  # noqa: E402
from lctrain.planning.traffic import attention_traffic  # noqa: E402

LAYOUTS = {"ring": (1, "zigzag"), "ring-contiguous": (1, "none"), "ulysses": (None, "zigzag"),
           "usp": (2, "zigzag"), "allgather": (1, "zigzag")}


def _groups(p: int, algorithm: str, uly: int) -> CPGroups:
    topo = Topology(cp_ring=p // uly, cp_ulysses=uly)
    return cp_groups(topo, build_mesh(topo, "cpu"), dist.get_rank())


def _inputs(S, H, Hkv, hd, g, lb, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, H, hd, generator=gen)
    k, v = (torch.randn(1, S, Hkv, hd, generator=gen) for _ in range(2))
    return [sequence.split(x, 1, g.cp_rank, g.cp_size, lb).requires_grad_() for x in (q, k, v)]


def _algo(name: str) -> str:
    return name.split("-")[0]


def _traffic_rank(p, S, H, Hkv, hd):
    out = {}
    for name, (uly, lb) in LAYOUTS.items():
        if name == "usp" and p < 4:
            continue
        uly = p if uly is None else uly
        g = _groups(p, _algo(name), uly if _algo(name) in ("ulysses", "usp") else 1)
        q, k, v = _inputs(S, H, Hkv, hd, g, lb)
        attn = ContextParallelAttention(_algo(name), g, S, lb)
        with record_traffic() as fwd:
            o, _ = attn.attention(q, k, v)
        with record_traffic() as bwd:
            o.sum().backward()
        want = attention_traffic(_algo(name), S, H * hd, Hkv * hd, p, g.ulysses_size)
        out[name] = (fwd.total() / want["forward"], bwd.total() / want["backward"],
                     want["forward"])
    return out


def section_traffic() -> None:
    print("\n## traffic: measured / formula (elements sent per rank; S=1536, H=8, H_kv=8, d=64)")
    print(f"{'P':>3} {'algorithm':<16} {'fwd ratio':>9} {'bwd ratio':>9} {'fwd elements':>13}")
    for p in (2, 4, 8):
        res = run_ranks(_traffic_rank, p, (p, 1536, 8, 8, 64), timeout_s=600)
        for name, (rf, rb, elems) in res[0].items():
            assert all(r[name][:2] == (rf, rb) for r in res), "ranks disagree"
            print(f"{p:>3} {name:<16} {rf:>9.2f} {rb:>9.2f} {elems:>13,.0f}")


WINDOW_SEQ, WINDOW_HEADS, WINDOW_HEAD_DIM = 3072, 4, 16


def _window_rank(p: int, windows: tuple[int, ...]) -> dict:
    """{(algorithm, window or None): elements this rank sent, forward + backward}."""
    out = {}
    S, H, hd = WINDOW_SEQ, WINDOW_HEADS, WINDOW_HEAD_DIM
    for name in ("ring", "usp", "allgather"):
        if name == "usp" and p < 4:
            continue
        g = _groups(p, name, 2 if name == "usp" else 1)
        attn = ContextParallelAttention(name, g, S, "zigzag")
        for window in (None, *windows):
            q, k, v = _inputs(S, H, H, hd, g, "zigzag")
            with record_traffic() as rec:
                attn.attention(q, k, v, window=window)[0].sum().backward()
            out[name, window] = rec.total(tag=name)
    return out


def section_window(windows: tuple[int, ...] = (64, 256)) -> None:
    d_kv = WINDOW_HEADS * WINDOW_HEAD_DIM
    print(f"\n## window layers: most elements sent by a rank, forward + backward (S={WINDOW_SEQ},"
          f" H=H_kv={WINDOW_HEADS}, d={WINDOW_HEAD_DIM}, zigzag chunks S/2P)")
    print(f"{'P':>3} {'algorithm':<10} {'full':>10} " + " ".join(
        f"{f'W={w}':>10} {'/full':>7} {'/4(W-1)d':>9}" for w in windows))
    for p in (2, 4, 8):
        res = run_ranks(_window_rank, p, (p, windows), timeout_s=600)
        for name in ("ring", "usp", "allgather"):
            if (name, None) not in res[0]:
                continue
            most = {w: max(r[name, w] for r in res) for w in (None, *windows)}
            cells = " ".join(f"{most[w]:>10,} {most[w] / most[None]:>7.4f} "
                             f"{most[w] / (4 * (w - 1) * d_kv):>9.3f}"
                             for w in windows)
            print(f"{p:>3} {name:<10} {most[None]:>10,} {cells}")


def section_balance() -> None:
    print("\n## causal balance: max / mean query-key pairs computed per rank (S = 4096 * P)")
    print(f"{'P':>3} {'contiguous':>11} {'zigzag':>8}")
    for p in (2, 4, 8):
        S, row = 4096 * p, []
        for lb in ("none", "zigzag"):
            blocks = [Block(sequence.positions(S, r, p, lb)) for r in range(p)]
            work = []
            for qb in blocks:
                work.append(pairs_computed(kernel_calls(
                    qb, Block(torch.cat([b.pos for b in blocks])), True)))
            row.append(max(work) / statistics.mean(work))
        print(f"{p:>3} {row[0]:>11.3f} {row[1]:>8.3f}")


def _time_fwd_bwd(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _single(S, H, hd, reps):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, H, hd, generator=gen).requires_grad_() for _ in range(3))
    b = Block(torch.arange(S))
    return _time_fwd_bwd(lambda: local_attention(q, k, v, b, b, causal=True,
                                                 scale=hd**-0.5)[0].sum().backward(), reps)


def _parallel(name, S, H, hd, reps):
    uly, lb = LAYOUTS[name]
    p = dist.get_world_size()
    uly = p if uly is None else uly
    g = _groups(p, _algo(name), uly if _algo(name) in ("ulysses", "usp") else 1)
    q, k, v = _inputs(S, H, H, hd, g, lb)
    attn = ContextParallelAttention(_algo(name), g, S, lb)
    t = _time_fwd_bwd(lambda: attn.attention(q, k, v)[0].sum().backward(), reps)
    x = torch.tensor([t])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
    return float(x)


def section_efficiency(S: int, reps: int) -> None:
    H, hd, p = 8, 64, 2
    print(f"\n## CPU parallel efficiency, causal fwd+bwd, S={S}, H={H}, d={hd}, P={p}, "
          "1 thread per rank")
    t1 = run_ranks(_single, 1, (S, H, hd, reps), backend=None, timeout_s=1200)[0]
    print(f"single process: {t1:.2f} s")
    print(f"{'algorithm':<16} {'t(P ranks) s':>12} {'efficiency':>10}")
    for name in ("ring-contiguous", "ring", "ulysses", "allgather"):
        tp = run_ranks(_parallel, p, (name, S, H, hd, reps), timeout_s=1200)[0]
        label = {"ring": "ring zigzag", "ring-contiguous": "ring"}.get(name, name)
        print(f"{label:<16} {tp:>12.2f} {t1 / (p * tp):>10.1%}")


def _maxlen_rank(S: int) -> tuple[float, float]:
    from lctrain.config import LctrainConfig
    from lctrain.training.loop import train

    cfg = LctrainConfig()  # model: the tiny preset's defaults
    cfg.parallel.cp, cfg.parallel.attention = 8, "ring"
    cfg.train.steps, cfg.train.seq_len, cfg.train.global_batch = 1, S, 1
    cfg.logging.progress = False
    t0 = time.perf_counter()
    train(cfg, f"/tmp/lctrain-bench-maxlen-{S}")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, time.perf_counter() - t0


def section_maxlen(lengths: list[int]) -> None:
    print("\n## tiny model (conf/model/tiny.yaml), cp=8 ring zigzag, one training step per length")
    print(f"{'seq_len':>8} {'peak RSS/rank GiB':>18} {'8 ranks GiB':>12} {'step s':>8}")
    points = []
    for S in lengths:
        res = run_ranks(_maxlen_rank, 8, (S,), backend=None, timeout_s=3000)
        peak = max(r[0] for r in res)
        points.append((S, peak))
        print(f"{S:>8} {peak:>18.3f} {8 * peak:>12.2f} {res[0][1]:>8.1f}", flush=True)
    (s0, m0), (s1, m1) = points[0], points[-1]
    slope = (m1 - m0) / (s1 - s0)
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    s_max = s1 + (avail / 8 - m1) / slope if slope > 0 else float("inf")
    print(f"linear fit: {slope * 2**20:.3f} GiB per 1M tokens per rank; {avail:.1f} GiB available "
          f"-> about {s_max:,.0f} tokens fit 8 ranks (extrapolated; the largest length run is "
          f"{s1:,})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", choices=["traffic", "balance", "efficiency", "maxlen", "window",
                                          "all"],
                    default="all")
    ap.add_argument("--efficiency-seq", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--maxlen-seqs", type=int, nargs="+", default=[4096, 16384])
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.section in ("traffic", "all"):
        section_traffic()
    if args.section in ("balance", "all"):
        section_balance()
    if args.section in ("efficiency", "all"):
        section_efficiency(args.efficiency_seq, args.reps)
    if args.section in ("maxlen", "all"):
        section_maxlen(args.maxlen_seqs)
    if args.section in ("window", "all"):
        section_window()


if __name__ == "__main__":
    main()
