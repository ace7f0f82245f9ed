"""The host's planning per micro-batch against the GPU time it plans for (issue: host planning
off the GPU's path; docs/parallelism.md §24, §25, §29).

Each micro-batch of packed documents is planned on the host before its kernels can start: the
documents split's positions (load_balance=documents), the blocks and their document ids, the
tokens that travel (ring and all-gather KV), the halo of the window layers, and the kernel
calls of every (query block, key block) pair, packed as variable-length groups for the CUDA
kernels. This times all of it for ring rank 0 of a cp ring (planned afresh: a new micro-batch),
on one row of --seq-len tokens of log-uniform documents (`LENGTH_MIXES`, 256 to 128K tokens),
dense (every layer full causal) and with window layers (a Gemma-3-like model: full and window
layers, whose halo and band calls are planned once per micro-batch, not per layer), zigzag
and documents splits. Beside it, the attention time the planner's H100 defaults give that
micro-batch on its busiest rank (the step waits for it; every rank plans alike): the (query,
key) pairs its calls compute (`pairs_computed`: the documents' own triangles, the window's
bands) x the training FLOPs per pair of Llama-3-8B
shapes (32 layers, 4096 query width; a window model: one full layer in six) at the
attention efficiency of `plan.*` (`hardware_from_plan`). `share` is each micro-batch's planning
/ its attention, the median over --repeats micro-batches (each its own documents), and `worst`
the largest; the goal is at most 2% (the host plans the next micro-batch while the GPU runs
this one only if it is that much shorter).

    python bench/host_planning.py                    # 128K and 1M tokens, cp 8 and 16
    python bench/host_planning.py --seq-len 131072 --cp 8 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from lctrain.attention import ContextParallelAttention
from lctrain.attention.algorithms import CPGroups
from lctrain.attention.calls import pairs_computed
from lctrain.attention.halo import halo_plan
from lctrain.attention.travel import travel_plan
from lctrain.config import LctrainConfig
from lctrain.config.compose import compose
from lctrain.config.model_size import TRAIN_OVER_FORWARD
from lctrain.layout import sequence
from lctrain.layout.packed import LENGTH_MIXES, sample_rows
from lctrain.planning.hardware import hardware_from_plan

WINDOW = 4096
FULL_EVERY = 6
"""The window model: one full-attention layer in six (Gemma 3's pattern), window 4096."""


def document_ids(seq_len: int, seed: int) -> torch.Tensor:
    """One row [1, S] of stream-packed log-uniform documents, as ids 0, 1, ..."""
    (lengths,) = sample_rows(LENGTH_MIXES["loguniform"], seq_len, 1, seed)
    return torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))[None]


def plan_micro_batch(seq_len: int, cp: int, balance: str, doc: torch.Tensor,
                     window: int | None, rank: int = 0) -> list:
    """Everything ring rank `rank` plans for one micro-batch: the kernel calls of each kind of
    layer it runs (full; and window, with their halo)."""
    attn = ContextParallelAttention("ring", CPGroups(None, None, None, ring_size=cp,
                                                     ring_rank=rank), seq_len, balance)
    qb, kbs = attn.blocks(doc)
    travel = travel_plan(kbs, True)
    arriving = kbs if travel is None else [t.block for t in travel]
    calls = [c for kb in arriving for c in qb.calls(kb, True)]
    for kb in arriving:
        qb.varlen_groups(kb, True)
    if window is None:
        return [calls]
    halo = halo_plan(kbs, rank, window)
    window_calls = [c for kb in (qb, *(t.block for t in halo.recv.values()))
                    for c in qb.calls(kb, True, window)]
    for kb in (qb, *(t.block for t in halo.recv.values())):
        qb.varlen_groups(kb, True, window)
    return [calls, window_calls]


def attention_seconds(cfg: LctrainConfig, calls_by_kind: list, window: bool) -> float:
    """The planner's attention time of rank 0's calls over every layer of the model."""
    m, hw = cfg.model, hardware_from_plan(cfg)
    per_pair = TRAIN_OVER_FORWARD * 4 * m.q_dim
    if window:
        full_layers = m.n_layers // FULL_EVERY
        layers = [full_layers, m.n_layers - full_layers]
    else:
        layers = [m.n_layers]
    flops = sum(n * pairs_computed(calls) * per_pair for n, calls in zip(layers, calls_by_kind))
    return flops / hw.flops_per_s(hw.attention_efficiency)


def measure(seq_len: int, cp: int, balance: str, window: int | None, repeats: int,
            cfg: LctrainConfig) -> dict:
    """Planning and attention of `repeats` micro-batches (one row each, seeds 0, 1, ...: every
    table row plans the same documents): the medians, and the share of each micro-batch's
    planning in its own attention time (median and worst). Planned afresh: the documents split
    that an earlier row cached is forgotten first."""
    planning, attention, shares, calls = [], [], [], 0
    for seed in range(repeats):
        doc = document_ids(seq_len, seed)
        sequence.forget_splits()
        started = time.perf_counter()
        planned = plan_micro_batch(seq_len, cp, balance, doc, window)
        planning.append(time.perf_counter() - started)
        # the step's attention waits for the busiest rank (each plans its own alike)
        attention.append(max(attention_seconds(
            cfg, plan_micro_batch(seq_len, cp, balance, doc, window, rank), window is not None)
            for rank in range(cp)))
        shares.append(planning[-1] / attention[-1])
        calls = max(calls, sum(len(c) for c in planned))
    return {"seq_len": seq_len, "cp": cp, "balance": balance,
            "model": "dense" if window is None else f"window {window}",
            "planning_ms": 1e3 * statistics.median(planning),
            "attention_ms": 1e3 * statistics.median(attention),
            "share": statistics.median(shares), "worst_share": max(shares), "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[131072, 1048576])
    parser.add_argument("--cp", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=5, help="micro-batches (seeds) per row")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = compose(["model=llama3-8b"]).cfg
    rows = [measure(s, cp, balance, window, args.repeats, cfg)
            for s in args.seq_len for cp in args.cp for balance in ("zigzag", "documents")
            for window in (None, WINDOW)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'seq_len':>9} {'cp':>3} {'balance':>9} {'model':>12} {'calls':>7} "
          f"{'planning ms':>12} {'attention ms':>13} {'share':>7} {'worst':>7}")
    for r in rows:
        print(f"{r['seq_len']:>9} {r['cp']:>3} {r['balance']:>9} {r['model']:>12} "
              f"{r['calls']:>7} {r['planning_ms']:>12.1f} {r['attention_ms']:>13.1f} "
              f"{r['share']:>7.2%} {r['worst_share']:>7.2%}")


if __name__ == "__main__":
    main()
