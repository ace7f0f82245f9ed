"""Context parallelism over packed documents of mixed lengths: the balanced split per row
(parallel.load_balance=documents) against zigzag, counted for every algorithm and timed on the
CPU (docs/parallelism.md §24). Prints a table, or the rows as JSON.

    python bench/packed_cp.py                      # 128K counted (~45 s), 16K timed (~4 min)
    python bench/packed_cp.py --no-time --json     # counted rows only, as a JSON list
    python bench/packed_cp.py --lengths lengths.txt --mixes --cp 8   # a corpus's own lengths

Workloads: --rows rows of --seq-len tokens of each mix of lctrain.layout.packed.LENGTH_MIXES,
stream-packed (`sample_rows`), and with --lengths a file of document lengths, one a line,
packed by `pack_stream` (its mix is the file's stem). Every algorithm of the registry runs at
each Ulysses degree the layout search tries at cp ranks (`searched_degrees`), in three variants:
  zigzag     kv=all         how lctrain ran before: zigzag chunks, every K/V block sent whole;
  zigzag     kv=travelling  zigzag chunks, only the tokens other ranks attend travel (travel.py);
  documents  kv=travelling  each row split by its own documents (`sequence.document_ranges`).

Counted, without processes, from the attention's own blocks: each cp rank's positions
(`sequence.positions`, documents per row), its algorithm's blocks rule on a `CPGroups` filled
in by hand, a `Block` per positions tensor with the row's document ids, sorted into position
order for the algorithms that sort (`sorts_positions`: Ulysses, USP), as the attention does.
  work   causal (query, key) pairs of a rank's kernel calls (`kernel_calls`: a full call of q
         queries and k keys is q k pairs, a causal one q (q + 1) / 2): its unit's query block
         (its ring group: Ulysses' is every token) against every key block it attends to,
         divided over the unit's Ulysses members (each computes H/u heads of it), so Ulysses is
         balanced by construction (1.00) and still counted. max/mean over the cp ranks, the
         mean over rows and the worst row. The kernels' calls are counted on the first
         --call-rows rows (Python, one call at a time) and checked there to equal
         `split_cost(...).work`, the layout's count from the lengths alone, which counts the
         other rows. The kv variants compute the same work.
  share  n / (S / units): the travelling tokens per row of the key blocks' plan (`travel_plan`:
         n, padded to the most of any unit), the units being the key blocks (ring groups, or
         ranks for all-gather KV); the largest over rows, which a micro-batch of them pads to.
         Ulysses sends no key block ("-"); kv=all sends every token (1).
  sent   elements one rank sends in one attention layer for one sequence, forward + backward:
         `attention_traffic` with d = d_kv = 1, so tokens x tensors (multiply by the width
         H_kv x head_dim, and by the bytes of each transfer's dtype, for bytes); the largest
         over rows (at the largest share) and the mean.

Timed (--no-time skips it): one causal attention forward + backward of the row of each mix
that zigzag balances worst at 4 ranks, at --time-seq-len tokens (its document lengths scaled by time_seq_len / seq_len, at least
one token each), B = 1, H = 4, H_kv = 2, head_dim 64, float32, on forked gloo ranks with one
thread each, cp 2 and 4 (those of --cp), every algorithm whose key blocks travel (Ulysses
degree below cp: Ring, all-gather KV, USP at u = 2 on 4 ranks); each variant the median of
--repeats after one warm-up: the wall time of the slowest rank, and `cpu`, the busiest rank's
CPU time of its (only) thread, what it computes without its waits. kv=all is the code before travel.py: inside
the ranks, `travel_plan` as Ring (and USP's ring) import it returns None (whole blocks go
round), and as all-gather KV imports it a plan in which every token travels (the whole
gather); the library is unchanged. The warm-up's traffic is checked to equal the formula at the
variant's share. `vs zz-all` is each variant's time over zigzag kv=all's; `t-work` the timed
row's own work max/mean (`split_cost` of the scaled lengths).
On a 2-core machine cp=4 time-slices its ranks: the wall time then follows the total work,
not the busiest rank's, and `cpu` is the number that shows the balance (what a rank with a
core, or a GPU, of its own would take).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lctrain.attention.allgather as allgather_module  # noqa: E402
import lctrain.attention.ring as ring_module  # noqa: E402
from lctrain.attention import CP_ATTENTION, ContextParallelAttention, CPGroups  # noqa: E402
from lctrain.attention.calls import Block, KeyBlocks, kernel_calls, pairs_computed  # noqa: E402
from lctrain.attention.travel import Travel, travel_plan  # noqa: E402
from lctrain.comm import record_traffic  # noqa: E402
from lctrain.config.cp_algorithms import CP_ALGORITHMS, cp_algorithm  # noqa: E402
from lctrain.layout import sequence  # noqa: E402
from lctrain.layout.packed import LENGTH_MIXES, pack_stream, sample_rows, split_cost  # noqa: E402
from lctrain.layout.topology import Topology  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.parallel.runtime import build_mesh, cp_groups  # noqa: E402
from lctrain.planning.cp_costs import cp_costs  # noqa: E402
from lctrain.planning.traffic import attention_traffic  # noqa: E402

VARIANTS = (("zigzag", "all"), ("zigzag", "travelling"), ("documents", "travelling"))
"""(load_balance, kv): the split, and which K/V tokens travel."""
TIMED_CP = (2, 4)
"""cp degrees timed (of --cp): as many ranks as a 2-core machine can time-slice."""
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
"""The timed attention's shape: GQA, heads divisible by USP's Ulysses degree 2."""


# ---- workloads -------------------------------------------------------------------------------

def load_workloads(args: argparse.Namespace) -> dict[str, list[np.ndarray]]:
    """mix -> its packed rows (document lengths, each summing to seq_len)."""
    out = {mix: sample_rows(LENGTH_MIXES[mix], args.seq_len, args.rows, args.seed)
           for mix in args.mixes}
    if args.lengths:
        lengths = np.loadtxt(args.lengths, dtype=np.int64, ndmin=1)
        rows = pack_stream(lengths[lengths > 0], args.seq_len)[:args.rows]
        if not rows:
            raise ValueError(f"--lengths {args.lengths} holds {int(lengths.sum()):,} tokens, "
                             f"fewer than one row of --seq-len {args.seq_len}")
        out[args.lengths.stem] = rows
    return out


def doc_ids(lengths: np.ndarray) -> torch.Tensor:
    """The row's document ids [1, S]."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.from_numpy(lengths))[None]


def scaled(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """The row's document lengths scaled to `seq_len` tokens in all, each at least 1 (what
    rounding adds or removes comes off or onto the longest documents)."""
    if len(lengths) > seq_len:
        raise ValueError(f"--time-seq-len {seq_len} is shorter than the {len(lengths)} documents "
                         f"of the row it scales")
    out = np.maximum(1, np.rint(lengths * seq_len / lengths.sum())).astype(np.int64)
    excess = int(out.sum()) - seq_len
    while excess:
        i = int(np.argmax(out))
        step = min(excess, int(out[i]) - 1) if excess > 0 else excess
        out[i] -= step
        excess -= step
    return out


def layouts(cp: int) -> list[tuple[str, int]]:
    """(algorithm, Ulysses degree) of every registered algorithm at each degree the layout
    search tries on cp ranks."""
    out = []
    for name in CP_ALGORITHMS:
        a = cp_algorithm(name)
        out += [(name, a.degree(cp, u)) for u in a.searched_degrees(cp)]
    return list(dict.fromkeys(out))


# ---- counted ---------------------------------------------------------------------------------

class RowSplits:
    """One packed row at cp ranks: each split's positions, cost and Blocks, made once and
    shared by the algorithms and ranks that ask (a Block per distinct positions, so its runs and
    plans are computed once, as the attention makes one per positions tensor)."""

    def __init__(self, lengths: np.ndarray, cp: int):
        self.lengths, self.cp = lengths, cp
        self.seq_len, self.doc = int(lengths.sum()), doc_ids(lengths)
        self._positions: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._costs: dict[tuple[str, int], np.ndarray] = {}
        self._blocks: list[tuple[torch.Tensor, Block]] = []

    def positions(self, lb: str, u: int) -> list[torch.Tensor]:
        """Every cp rank's positions ([S/cp], or [1, S/cp] for documents)."""
        if (lb, u) not in self._positions:
            self._positions[lb, u] = [sequence.positions(self.seq_len, r, self.cp, lb,
                                                         doc_ids=self.doc, ulysses=u)
                                      for r in range(self.cp)]
        return self._positions[lb, u]

    def unit_work(self, lb: str, u: int) -> np.ndarray:
        """The layout's count of each unit's work (`split_cost`, units of u ranks)."""
        if (lb, u) not in self._costs:
            self._costs[lb, u] = split_cost(self.lengths, self.cp, lb, ulysses=u).work
        return self._costs[lb, u]

    def block(self, pos: torch.Tensor) -> Block:
        """The Block of these positions with the row's document ids."""
        for p, b in self._blocks:
            if p.shape == pos.shape and torch.equal(p, pos):
                return b
        self._blocks.append((pos, Block(pos, sequence.take(self.doc, pos, 1))))
        return self._blocks[-1][1]

    def blocks(self, name: str, lb: str, u: int, cp_rank: int) -> tuple[Block, list[Block]]:
        """(query block, key blocks) of `cp_rank` under `name`'s blocks rule, in position order
        when the algorithm sorts them (`sorts_positions`)."""
        groups = CPGroups(None, None, None, ring_size=self.cp // u, ring_rank=cp_rank // u,
                          ulysses_size=u, ulysses_rank=cp_rank % u)
        query, keys = CP_ATTENTION[name].blocks(self.positions(lb, u), groups)
        made = [self.block(p) for p in (query, *keys)]
        if cp_costs(name).memory.sorts_positions:
            made = [b.ordered.block for b in made]
        return made[0], made[1:]


def count_layout(row: RowSplits, name: str, u: int, lb: str,
                 with_calls: bool) -> tuple[np.ndarray, float | None]:
    """(work of each cp rank, travelling share or None when no key block travels) of one row
    under one algorithm and split."""
    work = row.unit_work(lb, u)
    if with_calls:
        counted = np.array([sum(pairs_computed(kernel_calls(qb, kb, True)) for kb in keys)
                            for qb, keys in (row.blocks(name, lb, u, r)
                                             for r in range(0, row.cp, u))], dtype=np.float64)
        assert np.array_equal(counted, work), (name, row.cp, u, lb, counted, work)
    _, keys = row.blocks(name, lb, u, 0)
    share = None
    if len(keys) > 1:
        share = travel_plan(KeyBlocks(keys), causal=True)[0].size / (row.seq_len / len(keys))
    return np.repeat(work / u, u), share


def count_rows(workloads: dict[str, list[np.ndarray]], cps: list[int],
               call_rows: int) -> list[dict]:
    """One row dict per (mix, cp, algorithm, Ulysses degree, variant)."""
    out = []
    for mix, rows in workloads.items():
        seq_len = int(rows[0].sum())
        for cp in cps:
            found: dict[tuple[str, int, str], list] = {}
            for i, lengths in enumerate(rows):
                row = RowSplits(lengths, cp)
                for name, u in layouts(cp):
                    for lb in ("zigzag", "documents"):
                        work, share = count_layout(row, name, u, lb, i < call_rows)
                        found.setdefault((name, u, lb), []).append(
                            (work.max() / work.mean(), share))
            for (name, u, lb), got in found.items():
                out += [counted_row(mix, seq_len, cp, name, u, lb, kv, got)
                        | {"call_rows": min(call_rows, len(rows))}
                        for variant_lb, kv in VARIANTS if variant_lb == lb]
    return out


def counted_row(mix: str, seq_len: int, cp: int, name: str, u: int, lb: str, kv: str,
                got: list[tuple[float, float | None]]) -> dict:
    """The row dict of one layout and variant from each packed row's (work max/mean, share)."""
    balance = [b for b, _ in got]
    shares = [1.0 if s is None or kv == "all" else s for _, s in got]
    sent = [sum(attention_traffic(name, seq_len, 1, 1, cp, u, share=s).values())
            for s in shares]
    travels = got[0][1] is not None
    return {"mix": mix, "seq_len": seq_len, "rows": len(got), "cp": cp, "algorithm": name,
            "ulysses": u, "load_balance": lb, "kv": kv,
            "work_max_over_mean": float(np.mean(balance)),
            "work_max_over_mean_worst": float(np.max(balance)),
            "share_max": max(shares) if travels else None,
            "sent_elements_max": max(sent), "sent_elements_mean": float(np.mean(sent))}


# ---- timed -----------------------------------------------------------------------------------

def _every_token_travels(blocks: list[Block]) -> list[Travel]:
    """A travel plan that sends each block whole (its tokens in local order)."""
    out = []
    for b in blocks:
        pos = b.pos.expand_as(b.doc) if b.pos.dim() == 1 else b.pos
        index = torch.arange(pos.shape[1]).expand_as(pos).contiguous()
        out.append(Travel(index, Block(pos, b.doc)))
    return out


@contextlib.contextmanager
def every_kv_sent() -> Iterator[None]:
    """Inside the block the attention sends every K/V token, as before travel.py: Ring's (and
    USP's) plan is None, all-gather KV's gathers every token. Planned once per list of blocks,
    like `travel_plan`."""
    plans: dict[tuple[int, ...], tuple[list[Block], list[Travel]]] = {}

    def whole(blocks: list[Block], causal: bool) -> list[Travel]:
        key = tuple(id(b) for b in blocks)
        if key not in plans or any(a is not b for a, b in zip(plans[key][0], blocks)):
            plans[key] = (list(blocks), _every_token_travels(blocks))
        return plans[key][1]

    saved = ring_module.travel_plan, allgather_module.travel_plan
    ring_module.travel_plan, allgather_module.travel_plan = (lambda blocks, causal: None), whole
    try:
        yield
    finally:
        ring_module.travel_plan, allgather_module.travel_plan = saved


def _median_seconds(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(median wall time of `fn` over `repeats`, of the slowest rank; median CPU time of this
    rank's thread, of the busiest rank). The CPU time is what a rank computes, waits left out:
    on a CPU shared by more ranks than cores the wall time follows the total work, and the
    busiest rank's CPU time is what a rank with a core (a GPU) of its own would take."""
    walls, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    slowest = torch.tensor([statistics.median(walls), statistics.median(cpus)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest[0]), float(slowest[1])


def _step(attn: ContextParallelAttention, ins: list[torch.Tensor],
          doc: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of the attention on this rank's q, k, v."""
    return lambda: attn.attention(*ins, doc)[0].sum().backward()


def _time_rank(lengths: np.ndarray, timed: list[tuple[str, int]],
               repeats: int) -> dict[tuple[str, int, str, str], tuple[float, float]]:
    """On every rank: {(algorithm, u, load_balance, kv): (wall seconds, busiest rank's CPU
    seconds)} of one forward + backward."""
    cp, seq_len, doc = dist.get_world_size(), int(lengths.sum()), doc_ids(lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq_len, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, seq_len, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    meshes, out = {}, {}
    for name, u in timed:
        topo = Topology(cp_ring=cp // u, cp_ulysses=u)
        if u not in meshes:
            meshes[u] = build_mesh(topo, "cpu")
        g = cp_groups(topo, meshes[u], dist.get_rank())
        for lb, kv in VARIANTS:
            ins = [sequence.split(x, 1, g.cp_rank, cp, lb, doc_ids=doc, ulysses=u)
                   .requires_grad_() for x in (q, k, v)]
            attn = ContextParallelAttention(name, g, seq_len, lb)
            with every_kv_sent() if kv == "all" else contextlib.nullcontext():
                with record_traffic() as sent:  # the warm-up sends what the variant should
                    _step(attn, ins, doc)()
                out[name, u, lb, kv] = _median_seconds(_step(attn, ins, doc), repeats)
            keys = attn.blocks(doc)[1]
            share = 1.0 if kv == "all" else \
                travel_plan(keys, causal=True)[0].size / (seq_len / len(keys))
            want = sum(attention_traffic(name, seq_len, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                         cp, u, share=share).values())
            assert abs(sent.total() - want) <= 1e-9 * want, (name, u, lb, kv, sent.total(), want)
    return out


def time_rows(rows: list[dict], workloads: dict[str, list[np.ndarray]], cps: list[int],
              seq_len: int, repeats: int) -> None:
    """Adds `seconds` (and the ratio to zigzag kv=all) to the counted rows it times."""
    by_key = {(r["mix"], r["cp"], r["algorithm"], r["ulysses"], r["load_balance"], r["kv"]): r
              for r in rows}
    for mix, mix_rows in workloads.items():
        # the row zigzag balances worst at 4 ranks, scaled to the timed length
        candidates = [scaled(r, seq_len) for r in mix_rows]
        lengths = max(candidates, key=lambda r: split_cost(r, min(4, max(cps)), "zigzag")
                      .max_over_mean)
        for cp in (c for c in TIMED_CP if c in cps):
            timed = [(name, u) for name, u in layouts(cp) if u < cp]
            got = run_ranks(_time_rank, cp, (lengths, timed, repeats), timeout_s=3600)[0]
            for (name, u, lb, kv), (seconds, cpu) in got.items():
                base, base_cpu = got[name, u, "zigzag", "all"]
                by_key[mix, cp, name, u, lb, kv] |= {
                    "time_seq_len": seq_len, "seconds": seconds,
                    "seconds_over_zigzag_all": seconds / base,
                    "rank_cpu_seconds_max": cpu, "cpu_over_zigzag_all": cpu / base_cpu,
                    "time_work_max_over_mean": split_cost(lengths, cp, lb, u).max_over_mean}


# ---- output ----------------------------------------------------------------------------------

def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"# packed documents, {args.rows} rows of {args.seq_len:,} tokens per mix (work from "
          f"kernel calls on {args.call_rows}); sent = elements per rank, layer and sequence, "
          f"fwd + bwd, d = d_kv = 1")
    if not args.no_time:
        print(f"# timed: the row zigzag balances worst, scaled to {args.time_seq_len:,} tokens, "
              f"H={HEADS}, H_kv={KV_HEADS}, d={HEAD_DIM}, float32, 1 thread per rank, median of "
              f"{args.repeats}; cpu = the busiest rank's compute (its thread's CPU time)")
    print(f"{'mix':<11} {'cp':>3} {'algorithm':<12} {'balance':<10} {'kv':<10} "
          f"{'work max/mean':>13} {'worst':>6} {'share':>6} {'sent max':>12} {'sent mean':>12} "
          f"{'seconds':>8} {'vs zz-all':>9} {'cpu':>7} {'vs zz-all':>9} {'t-work':>6}")
    for r in rows:
        name = r["algorithm"] if r["algorithm"] != "usp" else f"usp(u={r['ulysses']})"
        share = "-" if r["share_max"] is None else f"{r['share_max']:.3f}"
        timed = (f"{r['seconds']:>8.3f} {r['seconds_over_zigzag_all']:>9.2f} "
                 f"{r['rank_cpu_seconds_max']:>7.3f} {r['cpu_over_zigzag_all']:>9.2f} "
                 f"{r['time_work_max_over_mean']:>6.3f}" if "seconds" in r else "")
        print(f"{r['mix']:<11} {r['cp']:>3} {name:<12} {r['load_balance']:<10} {r['kv']:<10} "
              f"{r['work_max_over_mean']:>13.3f} {r['work_max_over_mean_worst']:>6.3f} "
              f"{share:>6} {r['sent_elements_max']:>12,.0f} {r['sent_elements_mean']:>12,.0f} "
              f"{timed}".rstrip())


def check_args(args: argparse.Namespace) -> None:
    """Every length the splits cannot cut (zigzag: 2 cp equal chunks; documents: at least
    2 cp^2 tokens, docs/parallelism.md §24), raised at once."""
    timed = [] if args.no_time else [cp for cp in TIMED_CP if cp in args.cp]
    problems = []
    for flag, seq_len, cps in (("--seq-len", args.seq_len, args.cp),
                               ("--time-seq-len", args.time_seq_len, timed)):
        problems += [f"{flag} {seq_len} at cp={cp}: needs a multiple of {2 * cp} of at least "
                     f"{2 * cp * cp}" for cp in cps if seq_len % (2 * cp) or seq_len < 2 * cp * cp]
    if not args.mixes and not args.lengths:
        problems.append("no workload: name --mixes or give --lengths")
    if problems:
        raise ValueError("; ".join(problems))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=131072, help="tokens per packed row")
    p.add_argument("--rows", type=int, default=20, help="packed rows per mix")
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--mixes", nargs="*", choices=sorted(LENGTH_MIXES),
                   default=list(LENGTH_MIXES), help="length mixes (none: only --lengths)")
    p.add_argument("--lengths", type=Path, help="a file of document lengths, one a line")
    p.add_argument("--seed", type=int, default=0, help="of the mixes' sampled rows")
    p.add_argument("--call-rows", type=int, default=4,
                   help="rows whose work is counted from the kernel calls (the rest: split_cost)")
    p.add_argument("--no-time", action="store_true", help="counted rows only")
    p.add_argument("--time-seq-len", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list instead")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    check_args(args)
    torch.set_num_threads(1)
    workloads = load_workloads(args)
    rows = count_rows(workloads, args.cp, args.call_rows)
    if not args.no_time:
        time_rows(rows, workloads, args.cp, args.time_seq_len, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, args)


if __name__ == "__main__":
    main()
