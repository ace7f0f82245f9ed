"""Context-parallel attention against the unsharded float64 reference, on gloo ranks.

Every rank builds the full q, k, v and output gradient, runs `reference_attention` on the whole
sequence in float64, shards with `lctrain.layout.sequence.split` (the data path's function),
runs the algorithm, and compares output, lse and dq/dk/dv. Traffic measured by `record_traffic` must equal
the formulas of `lctrain.planning.traffic` (docs/parallelism.md §5-8) exactly.
"""

import itertools
import zlib

import pytest
import torch
import torch.distributed as dist

from lctrain.attention import ContextParallelAttention, CPGroups
from lctrain.attention.calls import Block, kernel_calls
from lctrain.attention.kernels import KernelOptions
from lctrain.attention.local import local_attention
from lctrain.attention.varlen_reference import register_cpu_flash_ops
from lctrain.comm import record_traffic
from lctrain.config.cp_algorithms import algorithm_layouts, cp_algorithm
from lctrain.layout import sequence
from lctrain.layout.halo import halo_tokens
from lctrain.layout.topology import Topology
from lctrain.parallel.runtime import build_mesh
from lctrain.parallel.runtime import cp_groups as runtime_cp_groups
from lctrain.planning.cp_costs import cp_costs
from lctrain.planning.traffic import attention_traffic, layer_transfers
from tests.helpers import on_ranks
from tests.reference import reference_attention

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def doc_ids_from_lengths(lengths: list[int] | list[list[int]], batch: int) -> torch.Tensor:
    """Document ids [B, S]: one list of lengths for every row, rolled (different borders per
    sample), or a list per row."""
    if isinstance(lengths[0], list):
        return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                            for r in lengths])
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return torch.stack([ids.roll(7 * b) for b in range(batch)])


def packed_rows(seq_len: int, cp: int) -> list[list[int]]:
    """Two rows of different documents: many short ones, a 1-token one and one longer than
    S/cp; and documents of prime lengths (the last one whatever is left)."""
    short = [1, 3, 2, 5, 4, 9]
    long_doc = seq_len - sum(short)
    assert long_doc > seq_len // cp, (seq_len, cp)
    primes, left = [], seq_len
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61):
        if p >= left:
            break
        primes.append(p)
        left -= p
    return [short[:4] + [long_doc] + short[4:], primes + [left]]


def cp_groups(world: int, ring: int, ulysses: int, cache: dict) -> CPGroups:
    key = (ring, ulysses)
    if key not in cache:
        topo = Topology(dp=world // (ring * ulysses), cp_ring=ring, cp_ulysses=ulysses)
        cache[key] = (topo, build_mesh(topo, "cpu"))
    topo, mesh = cache[key]
    return runtime_cp_groups(topo, mesh, dist.get_rank())


def check_case(case: dict, cache: dict) -> None:
    algo, ring, uly = case["algorithm"], case["ring"], case["ulysses"]
    B, S, H, Hkv, hd = case["B"], case["S"], case["H"], case["Hkv"], case["hd"]
    dtype, lb, causal, rep = case["dtype"], case["lb"], case["causal"], case.get("rep", 1)
    g = cp_groups(dist.get_world_size(), ring, uly, cache)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(sorted(case.items())).encode()))
    q, dout = (torch.randn(B, S, H, hd, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, S, Hkv, hd, generator=gen, dtype=torch.float64) for _ in range(2))
    docs = doc_ids_from_lengths(case["docs"], B) if case.get("docs") else None
    # reference on the whole sequence, float64, from the inputs rounded to the test dtype
    ref_in = [x.to(dtype).double().requires_grad_() for x in (q, k, v)]
    full = Block(torch.arange(S), docs)
    scale = hd ** -0.5
    window = case.get("window")
    sink = torch.randn(H, generator=gen, dtype=torch.float64) if case.get("sink") else None
    ref_sink = None if sink is None else sink.to(dtype).double().requires_grad_()
    ref_out, ref_lse = reference_attention(*ref_in, full, full, causal, scale, window=window,
                                           sink=ref_sink)
    ref_out.backward(dout.to(dtype).double())

    u = cp_algorithm(algo).degree(g.cp_size, uly)

    def local(x, dim=1):  # documents: each row split by its documents, per balance unit
        return sequence.split(x, dim, g.cp_rank, g.cp_size, lb, doc_ids=docs, ulysses=u)

    ins = [local(x.to(dtype)).requires_grad_() for x in (q, k, v)]
    my_sink = None if sink is None else sink.to(dtype).requires_grad_()
    attn = ContextParallelAttention(algo, g, S, lb, causal=causal, kv_replication=rep,
                                    options=KernelOptions(backend=case.get("backend", "auto")))
    with record_traffic() as fwd:
        out, lse = attn.attention(*ins, docs, window, my_sink)
    with record_traffic() as bwd:
        out.backward(local(dout.to(dtype)))
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), local(ref_out.detach()), **tol, msg=f"out {case}")
    for name, x, r in zip("qkv", ins, ref_in):
        torch.testing.assert_close(x.grad.double(), local(r.grad), **tol, msg=f"d{name} {case}")
    if sink is not None:  # each rank's share of the sinks' gradient (its queries, its heads)
        total = my_sink.grad.double()
        dist.all_reduce(total, group=g.cp)
        torch.testing.assert_close(total, ref_sink.grad, **tol, msg=f"dsink {case}")
    # lse in the algorithm's core layout: Ulysses cores hold H/u heads of their group's tokens
    if u == 1:
        ref_core = local(ref_lse.detach(), dim=2)
    else:
        heads = slice(g.ulysses_rank * H // u, (g.ulysses_rank + 1) * H // u)
        pos = attn.blocks(docs)[0].pos  # the query block: the Ulysses group's tokens
        ref_core = sequence.take(ref_lse.detach()[:, heads], pos, 2)
    finite = torch.isfinite(ref_core)
    assert torch.equal(torch.isfinite(lse), finite), f"lse -inf rows differ {case}"
    torch.testing.assert_close(lse.double()[finite], ref_core[finite], **tol, msg=f"lse {case}")
    if window is not None and window < S:
        assert_halo(case, g, u, docs, fwd, bwd)
        return
    share = 1.0
    if docs is not None and u < g.cp_size:  # the ring's (all-gather's) key blocks: its units
        unit_pos = [torch.cat([sequence.positions(S, r, g.cp_size, lb, doc_ids=docs, ulysses=u)
                               .expand(B, -1) for r in range(i * u, (i + 1) * u)], dim=1)
                    for i in range(g.cp_size // u)]
        share = travelling_tokens(docs, unit_pos, causal) / (S * u // g.cp_size)
    assert_traffic(algo, fwd, bwd, S, H * hd, Hkv * rep * hd, g.cp_size, uly, B, dtype, case,
                   share)
    sends_kv = any(x.travelling for x in cp_costs(algo).transfers(S, 1, 1, g.cp_size, u))
    if case.get("silent") and sends_kv:  # whole documents per rank: no K/V moves
        moved = {k: v for rec in (fwd, bwd) for k, v in rec.elements.items()
                 if k[1] != "all_to_all"}
        assert share == 0 and not any(moved.values()), (moved, case)
    if lb == "documents":  # every rank computed the same split of every row
        mine = attn.rank_positions(docs)
        theirs = [None] * g.cp_size
        dist.all_gather_object(theirs, mine[g.cp_rank].tolist(), group=g.cp)
        assert theirs == [p.tolist() for p in mine], case


def unit_tokens(S: int, cp: int, lb: str, u: int, docs, B: int) -> list[list[list[tuple]]]:
    """[unit][row] -> the (document, position) of each of the unit's tokens (a ring group's
    members' tokens, or a rank's when u = 1)."""
    out = []
    for i in range(cp // u):
        pos = torch.cat([sequence.positions(S, r, cp, lb, doc_ids=docs, ulysses=u).expand(B, -1)
                         for r in range(i * u, (i + 1) * u)], dim=1)
        out.append([[(0 if docs is None else int(docs[b, p]), int(p)) for p in pos[b]]
                    for b in range(B)])
    return out


def assert_halo(case: dict, g, u: int, docs, fwd, bwd) -> None:
    """A window layer sends, to each other unit, the tokens that unit's queries see (counted
    token by token: same document, 0 <= query - key < W; the most of any row), K and V forward,
    and the dK and dV of what it received back in float32, and nothing to a unit out of reach;
    the count equals `lctrain.layout.halo.halo_tokens`, the traffic `attention_traffic(...,
    halo=)`."""
    algo, S, B, W = case["algorithm"], case["S"], case["B"], case["window"]
    held = unit_tokens(S, g.cp_size, case["lb"], u, docs, B)
    me = g.cp_rank // u

    def count(j: int, i: int) -> int:  # tokens of unit j that unit i's queries see
        return max(sum(any(d == dq and 0 <= pq - p < W for dq, pq in held[i][b])
                       for d, p in held[j][b]) for b in range(B))

    sends = {i: count(me, i) for i in range(len(held)) if i != me}
    halo = (sum(sends.values()), sum(count(i, me) for i in range(len(held)) if i != me))
    assert halo == halo_tokens(S, g.cp_size, W, case["lb"], u, docs)[me], case
    d_kv = case["Hkv"] * case.get("rep", 1) * case["hd"]
    assert_traffic(algo, fwd, bwd, S, case["H"] * case["hd"], d_kv, g.cp_size, u, B,
                   case["dtype"], case, halo=halo)
    if not any(x.travelling for x in cp_costs(algo).transfers(S, 1, 1, g.cp_size, u)):
        return  # it moves no key block (Ulysses; an algorithm that gathers them whole)
    # point to point only to the units within reach (their member with this rank's heads),
    # exactly their tokens (K and V, the heads this rank holds)
    reached = {dist.get_global_rank(g.cp, i * u + g.ulysses_rank % u): 2 * n * B * d_kv // u
               for i, n in sends.items() if n}
    assert dict(fwd.to_peer) == reached, (dict(fwd.to_peer), reached, case)


def travelling_tokens(docs: torch.Tensor, unit_pos: list[torch.Tensor], causal: bool) -> int:
    """n, counted token by token: the most tokens of one unit's row that another unit's queries
    attend (same document; causal: at or after the key), over units and rows."""
    most = 0
    for b in range(docs.shape[0]):
        held = [[(int(docs[b, p]), int(p)) for p in pos[b]] for pos in unit_pos]
        for j, mine in enumerate(held):
            latest: dict[int, int] = {}
            for i, theirs in enumerate(held):
                for d, p in theirs if i != j else ():
                    latest[d] = max(latest.get(d, -1), p)
            most = max(most, sum(d in latest and (latest[d] >= p or not causal)
                                 for d, p in mine))
    return most


def assert_traffic(algo, fwd, bwd, S, d, d_kv, cp, uly, B, dtype, case, share=1.0,
                   halo=None) -> None:
    """What `record_traffic` counted equals the algorithm's formula: elements per direction
    (`attention_traffic`; with documents the key blocks' travelling `share`; a window layer's
    `halo` tokens), bytes per transfer dtype (Ring's travelling dK/dV accumulators,
    all-gather's reduce-scattered dK/dV and the halo's dK/dV are float32, everything else the
    input dtype)."""
    itemsize = torch.finfo(dtype).bits // 8
    want = attention_traffic(algo, S, d, d_kv, cp, uly, batch=B, share=share, halo=halo)
    for direction, rec in (("forward", fwd), ("backward", bwd)):
        assert rec.total(tag=algo) == pytest.approx(want[direction], rel=1e-12), (
            direction, dict(rec.elements), want, case)
    float32 = {way: B * sum(x.elements for x in layer_transfers(algo, S, d, d_kv, cp, uly,
                                                                 share, halo)
                            if x.float32 and x.direction == way) for way in ("fwd", "bwd")}
    for (way, direction), rec in zip((("fwd", "forward"), ("bwd", "backward")), (fwd, bwd)):
        nbytes = (want[direction] - float32[way]) * itemsize + float32[way] * 4
        assert sum(rec.bytes.values()) == pytest.approx(nbytes, rel=1e-12), (
            direction, dict(rec.bytes), nbytes, case)


def run_cases(cases: list[dict]) -> int:
    register_cpu_flash_ops()
    cache: dict = {}
    for case in cases:
        check_case(case, cache)
    return len(cases)


def layouts_for(world: int) -> list[tuple[str, int, int]]:
    """(algorithm, ring size, Ulysses size) of every registered algorithm on `world` ranks, at
    each Ulysses degree the layout search tries (USP: 2 on 4 ranks, 2 and 4 on 8; none on 2)."""
    return [(name, world // u, u) for name, u in algorithm_layouts(world)]


def cases_for(world: int) -> list[dict]:
    layouts = layouts_for(world)
    shapes = [  # (H, Hkv, hd, replication): MHA, GQA, MQA, odd head counts and head dim 24
        (2 * world if world < 8 else 8, 2 * world if world < 8 else 8, 8, 1),
        (8, 2, 24, 1 if world == 2 else world // 2),
        (world * 3 if world < 8 else 24, 1, 16, world),
    ]
    out = []
    # on 8 ranks (all time-sliced on the CPU) what 8 adds: the degree-8 exchanges under the GQA
    # and MQA shapes, and the packed, window and sink cases of the layouts whose ring is 4 or 8
    # long (ring, all-gather, USP 4 x 2); Ulysses 8 and USP 2 x 4 run those cases' kinds of
    # exchange on 2 and 4 ranks
    if world == 8:
        shapes = shapes[1:]
    for (algo, ring, uly), (H, Hkv, hd, rep), causal, lb in itertools.product(
            layouts, shapes, (True, False), ("zigzag", "none")):
        u = uly
        if u == 1:
            rep = 1
        elif (Hkv * rep) % u or H % u:
            rep = u // Hkv if u % Hkv == 0 else 1
        if H % u or (Hkv * rep) % u or H % (Hkv * rep):
            continue
        if not causal and lb == "none":
            continue  # non-causal attention does not depend on the split
        out.append(dict(algorithm=algo, ring=ring, ulysses=uly, B=2, S=6 * 2 * world, H=H,
                        Hkv=Hkv, hd=hd, rep=rep, dtype=torch.float32, lb=lb, causal=causal,
                        docs=[5, 4 * world + 3, 8 * world - 8] if lb == "zigzag" else None))
    # bf16 on the main layouts, packed documents included
    for algo, ring, uly in layouts if world < 8 else [lay for lay in layouts if lay[1] >= 4]:
        out.append(dict(algorithm=algo, ring=ring, ulysses=uly, B=1, S=4 * world, H=2 * world,
                        Hkv=world, hd=16, rep=1, dtype=torch.bfloat16, lb="zigzag",
                        causal=True, docs=[3, 4 * world - 3]))
        # packed documents through the varlen path flash-attn takes on a GPU (plain-torch
        # varlen kernel with flash-attn's conventions), zigzag and contiguous
        for lb in ("zigzag", "none"):
            out.append(dict(algorithm=algo, ring=ring, ulysses=uly, B=2, S=6 * 2 * world,
                            H=2 * world, Hkv=world, hd=8, rep=1, dtype=torch.float32, lb=lb,
                            causal=True, docs=[5, 4 * world + 3, 8 * world - 8],
                            backend="reference"))
        # torch's flash-attention ops (the default CUDA backend without flash-attn), through
        # their CPU implementation that enforces the CUDA op's argument rules: dense and varlen
        for docs in (None, [5, 4 * world + 3, 8 * world - 8]):
            out.append(dict(algorithm=algo, ring=ring, ulysses=uly, B=2, S=6 * 2 * world,
                            H=2 * world, Hkv=world, hd=8, rep=1, dtype=torch.bfloat16,
                            lb="zigzag", causal=True, docs=docs, backend="torch"))
        # the balanced split per row (load_balance=documents): CPU kernels and varlen path;
        # then documents each held by one rank, which send nothing
        S = 28 * world
        for backend in ("cpu", "reference"):
            out.append(dict(algorithm=algo, ring=ring, ulysses=uly, B=2, S=S, H=2 * world,
                            Hkv=world, hd=8, rep=1, dtype=torch.float32, lb="documents",
                            causal=True, docs=packed_rows(S, world), backend=backend))
        out.append(dict(algorithm=algo, ring=ring, ulysses=uly, B=2, S=S, H=2 * world,
                        Hkv=world, hd=8, rep=1, dtype=torch.float32, lb="documents",
                        causal=True, docs=[[S // 8] * 8, [S // 8] * 8], silent=True))
        out += window_cases(algo, ring, uly, world) + sink_cases(algo, ring, uly, world)
    return out


def window_cases(algo: str, ring: int, uly: int, world: int) -> list[dict]:
    """Sliding-window layers: windows inside a zigzag chunk (6 tokens), spanning several
    chunks, and as long as the sequence (full attention); without and with packed documents;
    contiguous, zigzag and per-row documents splits; CPU kernels, the varlen path and torch's
    flash ops (bf16)."""
    S = 12 * world
    base = dict(algorithm=algo, ring=ring, ulysses=uly, B=2, S=S, H=2 * world, Hkv=world,
                hd=8, rep=1, dtype=torch.float32, causal=True)
    docs = [5, 4 * world + 3, 8 * world - 8]
    out = [dict(base, lb=lb, window=w, docs=None)
           for lb, w in (("zigzag", 4), ("zigzag", 15), ("none", 15), ("zigzag", S))]
    out += [dict(base, lb="zigzag", window=w, docs=docs, backend="reference") for w in (3, 15)]
    out.append(dict(base, lb="zigzag", window=7, docs=docs, backend="torch",
                    dtype=torch.bfloat16))
    out.append(dict(base, lb="none", window=1, docs=None))
    S = 28 * world
    out.append(dict(base, S=S, lb="documents", window=9, docs=packed_rows(S, world)))
    return out


def sink_cases(algo: str, ring: int, uly: int, world: int) -> list[dict]:
    """Attention sinks (a logit per head in every softmax denominator): without documents,
    with packed documents split per row, and with a window through the varlen path."""
    S = 12 * world
    base = dict(algorithm=algo, ring=ring, ulysses=uly, B=2, S=S, H=2 * world, Hkv=world,
                hd=8, rep=1, dtype=torch.float32, causal=True, sink=True)
    return [dict(base, lb="zigzag", docs=None),
            dict(base, lb="zigzag", docs=[5, 4 * world + 3, 8 * world - 8], window=7,
                 backend="reference"),
            dict(base, S=28 * world, lb="documents", docs=packed_rows(28 * world, world))]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(8, marks=pytest.mark.slow)])
def test_algorithms_match_unsharded_reference(world):
    cases = cases_for(world)
    assert len(cases) >= 12
    assert on_ranks(run_cases, world, cases, timeout_s=400) == [len(cases)] * world


def test_packed_documents_attend_block_diagonally_without_masks():
    """Packed documents split each run pair into same-document calls: no mask at all, work
    sum(l^2 / 2), and the same numbers as the masked float64 reference (also when document ids
    are not contiguous: an id that comes back pairs each of its stretches). On the CPU kernels
    and through the varlen path (the plain-torch varlen kernel flash-attn's path is tested
    with)."""
    lengths = [[10, 50, 36], [40, 1, 55]]
    docs = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(n)) for n in lengths])
    block = Block(torch.arange(96), docs)
    calls = list(kernel_calls(block, block, causal=True))
    assert all(c.kind == "causal" for c in calls)
    for b, row in enumerate(lengths):
        spans = sorted((qs.start, qs.stop) for bs, qs, *_ in calls if bs.start == b)
        assert [y - x for x, y in spans] == row
    gen = torch.Generator().manual_seed(0)
    for doc_ids in (docs, torch.stack([docs[0], docs[1].roll(5)])):  # second: not contiguous
        qkv = [torch.randn(2, 96, h, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2)]
        b = Block(torch.arange(96), doc_ids)
        ref_out, ref_lse = reference_attention(*qkv, b, b, True, 8 ** -0.5)
        ref_grads = torch.autograd.grad(ref_out.sum(), qkv)
        for backend in ("cpu", "reference"):
            out, lse = local_attention(*qkv, b, b, causal=True, scale=8 ** -0.5,
                                       options=KernelOptions(backend=backend))
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(lse, ref_lse)
            for g, r in zip(torch.autograd.grad(out.sum(), qkv), ref_grads):
                torch.testing.assert_close(g, r)
