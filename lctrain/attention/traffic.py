"""Elements each rank sends for one attention layer: the DIGEST section 4 formulas, and the
backward passes derived the same way. `lctrain plan` predicts with these; tests and
bench/attention.py compare them with what `lctrain.comm.record_traffic` measures.

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
