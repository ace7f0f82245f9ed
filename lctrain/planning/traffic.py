"""Elements each rank sends: one attention layer per context-parallel algorithm (forward and
backward), one block's TP/SP collectives, one step of FSDP. Derived in docs/parallelism.md
§2 and §5-9; `lctrain plan` predicts with these, and tests and bench/attention.py compare them
with what `lctrain.layout.comm.record_traffic` measures.

L: global sequence (one sample), d = H * head_dim and d_kv = H_kv * r * head_dim per TP rank
(r = KV replication), P = cp, u = Ulysses degree, R = ring degree = P / u.
"""

from __future__ import annotations


def attention_traffic(algorithm: str, seq_len: int, d: int, d_kv: int, cp: int, ulysses: int,
                      batch: int = 1) -> dict[str, float]:
    """{'forward': elements, 'backward': elements} sent per rank."""
    L, P, u = seq_len, cp, ulysses
    if P == 1:
        return {"forward": 0.0, "backward": 0.0}
    if algorithm == "allgather":
        # forward all-gathers K and V; backward reduce-scatters dK and dV: same volume
        fwd = (P - 1) * 2 * (L / P) * d_kv
        return {"forward": batch * fwd, "backward": batch * fwd}
    if algorithm == "ulysses":
        u = P
    elif algorithm == "ring":
        u = 1
    R = P // u
    tokens = L / R  # tokens of one Ulysses group
    # all-to-all of Q, K, V and the output forward; of dO, dQ, dK, dV backward (same sizes)
    a2a = (2 * d + 2 * d_kv) * tokens * (u - 1) / u**2
    # ring: K, V blocks of L/R tokens with the 1/u of the heads this rank holds after the a2a;
    # backward sends K, V again plus the travelling dK, dV accumulators
    ring = (R - 1) * 2 * (L / R) * d_kv / u
    return {"forward": batch * (a2a + ring), "backward": batch * (a2a + 2 * ring)}


def tp_block_traffic(tokens: int, dim: int, tp: int) -> float:
    """One block's forward TP collectives on [tokens, dim] activations: with SP two all-gathers
    and two reduce-scatters, without it two all-reduces; either way 4 (t-1)/t tokens dim
    elements (the backward sends the same)."""
    return 4 * (tp - 1) / tp * tokens * dim


def dp_step_traffic(engine: str, blocks: int, root: int, shards: int, accum: int) -> float:
    """One optimizer step of data parallelism over `shards` ranks, for `blocks` and `root`
    parameters per rank and `accum` micro-steps (docs/parallelism.md §9).

    FSDP2: in every micro-step each block's parameters are all-gathered for the forward and again
    for the backward (they are freed in between), the root's once (never freed); gradients are
    reduce-scattered once, on the last micro-step. DDP: one all-reduce of the gradients."""
    return sum(_dp_parts(engine, blocks, root, shards, accum))


def _dp_parts(engine: str, blocks: int, root: int, shards: int,
              accum: int) -> tuple[float, float]:
    """(elements of weights gathered, elements of gradients reduced) per rank and step."""
    if shards == 1:
        return 0.0, 0.0
    share = (shards - 1) / shards
    if engine == "ddp":
        return 0.0, 2 * share * (blocks + root)
    return share * accum * (2 * blocks + root), share * (blocks + root)


def dp_step_bytes(engine: str, blocks: int, root: int, shards: int, accum: int,
                  compute_bytes: int) -> float:
    """`dp_step_traffic` in bytes: FSDP gathers weights in the compute dtype (bf16 under
    train.dtype=bf16: its mixed-precision policy) and reduces gradients in fp32; DDP all-reduces
    fp32 gradients."""
    gathered, reduced = _dp_parts(engine, blocks, root, shards, accum)
    return gathered * compute_bytes + reduced * 4
