"""What each context-parallel attention algorithm costs, as the planner counts it: the
collectives it issues per layer (docs/parallelism.md §5-8), the bytes it keeps and holds at the
backward's peak (§11, §16), the host plans it builds (§24), and the fixed costs the step-time
model calibrates (§15, §17). One entry per algorithm, registered under the name of its facts
entry (`lctrain.config.cp_algorithms`) and of its code (`lctrain.attention.algorithms`);
docs/extending.md is the checklist for adding one. Pure arithmetic.

Per-rank widths as in docs/parallelism.md §0: L the global sequence (one sample), d = H * head_dim
and d_kv = r * H_kv * head_dim per TP rank (r = KV replication), P = cp, u = Ulysses degree,
R = P / u the ring degree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lctrain.config.registry import Registry

KV_TENSORS = 2
"""K and V: what the ring passes and the all-gather gathers, two tensors of d_kv per token."""
ULYSSES_ALL_TO_ALLS = 4
"""All-to-alls of one Ulysses layer each way: Q, K, V in and the output back (§5); the backward
sends dO, dQ, dK, dV."""
HELD_GRAD_PAIRS = 3
"""dK/dV accumulator pairs the ring's backward holds at once: the rank's own, the one being
sent, the one arriving (§6, §16)."""


@dataclass(frozen=True)
class Transfer:
    """One collective of one attention layer: what one rank sends for one sequence."""

    collective: str
    """Its name in `cp_step_bytes`' keys (`{collective}_{direction}`): all_to_all, ring_kv,
    ring_grad, all_gather, reduce_scatter, or a new algorithm's own."""
    direction: str
    """fwd | bwd. Checkpointing that recomputes the attention sends the fwd ones again."""
    group: str
    """The topology group that carries it (`lctrain.layout.topology.GROUPS`): its bandwidth
    and its place in `lctrain plan`'s per-group traffic."""
    elements: float
    calls: int
    """Collective calls per layer and micro-batch (each pays plan latency, §15)."""
    float32: bool = False
    """Travels in float32 whatever the compute dtype (summed gradients: §6, §8)."""
    travelling: bool = False
    """It carries key blocks (or their gradients), of which packed documents send only the
    travelling share: the tokens some other rank attends (§24)."""

    @property
    def key(self) -> str:
        return f"{self.collective}_{self.direction}"


@dataclass(frozen=True)
class LayerShape:
    """One attention layer on one rank, as the memory formulas read it (docs/parallelism.md §0):
    the model's sizes, the layout's degrees and the compute dtype's bytes per element."""

    batch: int
    seq_len: int
    cp: int
    ulysses: int
    tp: int
    dim: int
    """The queries' width H x d (the model's dim unless model.head_dim says otherwise)."""
    heads: int
    kv_heads: int
    kv_replication: int
    compute_bytes: int

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def _nothing(_shape: LayerShape) -> float:
    return 0.0


def _no_plans(batch: int, seq_len: int, cp: int, share: float | None) -> float:
    return 0.0


def each_token_once(tokens: int, cp: int) -> int:
    """Blocks that together cover every token once (Ring's groups)."""
    return tokens


@dataclass(frozen=True)
class MemoryTerms:
    """What an algorithm adds to a rank's memory (docs/parallelism.md §11, §16)."""

    kept_per_token: Callable[[LayerShape], float] = _nothing
    """Bytes per local token the attention keeps for the backward beyond the local q, k, v,
    output and lse (`activation_formula`)."""
    buffers: Callable[[LayerShape], float] = _nothing
    """Device bytes held for a moment at the backward's peak (`attention_buffer_bytes`)."""
    block_tokens: Callable[[int, int], int] = each_token_once
    """(B S tokens of a micro-batch, cp) -> the tokens its blocks cover, each block once: the
    document ids (one int64 per row and token) its call plans hold with packed documents, and
    the positions with a split of its own per row (`planning_bytes`)."""
    travel_plans: Callable[[int, int, int, float | None], float] = _no_plans
    """(B, S, cp, travelling share, None without packed documents) -> host bytes of what it
    plans to send key blocks: with packed documents which of their tokens travel (§24);
    all-gather KV without them the positions of every token, one key block
    (`planning_bytes`)."""
    sorts_positions: bool = False
    """It sorts a zigzag group's tokens into position order: a sort index, its inverse and the
    sorted positions on the host, and the document ids a second time, in that order
    (`planning_bytes`)."""
    unmodelled: str = ""
    """What of its memory no formula counts (for the plan's memory notes)."""


@dataclass(frozen=True)
class TimingTerms:
    """What the step-time model needs beyond the transfers (docs/parallelism.md §15)."""

    fixed_costs: Callable[[int, int], dict[str, float]]
    """(ring degree R, Ulysses degree u) -> {calibrated fixed-cost feature: times per block}."""
    calibrated: bool = False
    """`lctrain plan --calibrate` measures it alone on 2 ranks, as the feature of its name."""


@dataclass(frozen=True)
class CPCosts:
    """What one context-parallel algorithm costs (`cp_costs`)."""

    name: str
    """The algorithm's name (`lctrain.config.cp_algorithms.CP_ALGORITHMS`)."""
    transfers: Callable[[float, float, float, int, int], tuple[Transfer, ...]]
    """(L, d, d_kv, P, u) -> its collectives of one layer and sequence, for P > 1."""
    memory: MemoryTerms
    timing: TimingTerms


CP_COSTS: Registry[CPCosts] = Registry("context-parallel algorithm's costs")


def cp_costs(name: str) -> CPCosts:
    return CP_COSTS[name]


# ---- Ulysses, Ring and USP: all-to-alls inside groups of u ranks, a ring across R of them -------

def ulysses_ring_transfers(L: float, d: float, d_kv: float, P: int,
                           u: int) -> tuple[Transfer, ...]:
    """USP's collectives (§7), Ulysses' at u = P (§5), Ring's at u = 1 (§6): the all-to-alls of
    Q, K, V and the output over the L/R tokens of a Ulysses group (the backward's the same
    size); the ring's K/V blocks of L/R tokens with the 1/u of the heads this rank holds, again
    in the backward with the travelling float32 dK/dV accumulators."""
    R = P // u
    out = []
    if u > 1:
        a2a = (2 * d + 2 * d_kv) * (L / R) * (u - 1) / u**2
        out += [Transfer("all_to_all", way, "cp_ulysses", a2a, ULYSSES_ALL_TO_ALLS)
                for way in ("fwd", "bwd")]
    if R > 1:
        ring = (R - 1) * KV_TENSORS * (L / R) * d_kv / u
        out += [Transfer("ring_kv", "fwd", "cp_ring", ring, R - 1, travelling=True),
                Transfer("ring_kv", "bwd", "cp_ring", ring, R - 1, travelling=True),
                Transfer("ring_grad", "bwd", "cp_ring", ring, R - 1, float32=True,
                         travelling=True)]
    return tuple(out)


def halo_transfers(transfers: tuple[Transfer, ...], halo: tuple[float, float], d_kv: float,
                   u: int) -> tuple[Transfer, ...]:
    """An algorithm's transfers in a window layer (§25): those that carry key blocks become the
    halo exchange. halo = (sent, received): K and V of the tokens of its balance unit that
    other units' windows reach, then the dK/dV of the tokens it received back in float32,
    with the 1/u of the heads this rank holds; the others (the Ulysses all-to-alls) stay. An
    algorithm that moves no key block (Ulysses) is unchanged."""
    moved = [x for x in transfers if x.travelling]
    if not moved:
        return transfers
    sent, received = halo
    group = moved[0].group
    return (*(x for x in transfers if not x.travelling),
            Transfer("halo_kv", "fwd", group, KV_TENSORS * sent * d_kv / u, KV_TENSORS),
            Transfer("halo_grad", "bwd", group, KV_TENSORS * received * d_kv / u, KV_TENSORS,
                     float32=True))


def ring_buffers(s: LayerShape) -> float:
    """The ring's K/V block arriving while the held one is computed, [B, L/R, r H_kv/(t u), d]
    x 2 in the compute dtype, and the float32 accumulators dQ [B, L/R, H/(t u), d] and
    HELD_GRAD_PAIRS dK/dV pairs (§6, §16); 0 without a ring."""
    if s.ring == 1:
        return 0.0
    tokens = s.batch * s.seq_len // s.ring
    kv = tokens * s.kv_heads * s.kv_replication // (s.tp * s.ulysses) * s.head_dim
    q = tokens * s.heads // (s.tp * s.ulysses) * s.head_dim
    return KV_TENSORS * kv * s.compute_bytes + 4 * (q + HELD_GRAD_PAIRS * KV_TENSORS * kv)


def ulysses_output_copy(s: LayerShape) -> float:
    """The output after the inverse all-to-all, a second copy that wo keeps (§5, §11)."""
    return s.compute_bytes * s.dim / s.tp


def ring_and_ulysses_costs(R: int, u: int) -> dict[str, float]:
    """The ring's calibrated extra once per exchange (R - 1 per block), Ulysses' once."""
    return {"ring": float(R - 1), "ulysses": float(u > 1)}


def ring_travel_plans(batch: int, seq_len: int, cp: int, share: float | None) -> float:
    """Each ring block's travelling tokens, `share` of them all: index, positions and document
    ids, three int64 each (§24); nothing without documents."""
    return 0.0 if share is None else 24 * share * batch * seq_len


ULYSSES_MEMORY = MemoryTerms(kept_per_token=ulysses_output_copy, sorts_positions=True,
                             unmodelled="Ulysses' all-to-all buffers")

CP_COSTS.add(CPCosts("ulysses", ulysses_ring_transfers, ULYSSES_MEMORY,
                     TimingTerms(ring_and_ulysses_costs, calibrated=True)))
CP_COSTS.add(CPCosts("ring", ulysses_ring_transfers,
                     MemoryTerms(buffers=ring_buffers, travel_plans=ring_travel_plans),
                     TimingTerms(ring_and_ulysses_costs, calibrated=True)))
CP_COSTS.add(CPCosts("usp", ulysses_ring_transfers,
                     MemoryTerms(ulysses_output_copy, ring_buffers, sorts_positions=True,
                                 travel_plans=ring_travel_plans,
                                 unmodelled=ULYSSES_MEMORY.unmodelled),
                     TimingTerms(ring_and_ulysses_costs)))


# ---- All-gather KV --------------------------------------------------------------------------

def allgather_transfers(L: float, d: float, d_kv: float, P: int,
                        u: int) -> tuple[Transfer, ...]:
    """K and V all-gathered forward, in the compute dtype; their gradients reduce-scattered
    backward in float32: the same volume (§8)."""
    gathered = (P - 1) * KV_TENSORS * (L / P) * d_kv
    return (Transfer("all_gather", "fwd", "cp", gathered, KV_TENSORS, travelling=True),
            Transfer("reduce_scatter", "bwd", "cp", gathered, KV_TENSORS, float32=True,
                     travelling=True))


def gathered_kv(s: LayerShape) -> float:
    """The gathered K and V kept for the backward: 2 d_kv (cp - 1)/t more per token (§8, §11)."""
    d_kv = s.kv_heads * s.head_dim
    return s.compute_bytes * KV_TENSORS * d_kv * (s.cp - 1) / s.tp


def gathered_kv_grads(s: LayerShape) -> float:
    """The gradients of the gathered K and V, [B, L, H_kv/t, d] x 2 in the compute dtype,
    before their reduce-scatter (§16)."""
    return KV_TENSORS * s.compute_bytes * s.batch * s.seq_len * s.kv_heads // s.tp * s.head_dim


def gathered_travel_plans(batch: int, seq_len: int, cp: int, share: float | None) -> float:
    """With documents every rank's travelling tokens (index, positions, document ids: three
    int64 each) and the key block of the own tokens and the others' travelling ones (positions
    and document ids) (§24); without, the key block of every token's positions (int64)."""
    if share is None:
        return 8 * seq_len
    tokens = batch * seq_len
    return 24 * share * tokens + 16 * tokens * (1 + (cp - 1) * share) / cp


def own_and_gathered(tokens: int, cp: int) -> int:
    """The rank's own tokens' (its query block) and every token's (the gathered key block)."""
    return tokens // cp + tokens


CP_COSTS.add(CPCosts("allgather", allgather_transfers,
                     MemoryTerms(gathered_kv, gathered_kv_grads,
                                 travel_plans=gathered_travel_plans),
                     TimingTerms(lambda R, u: {"allgather": 1.0}, calibrated=True)))
