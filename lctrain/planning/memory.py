"""Memory formulas per rank: parameters, weights + gradients + optimizer state per data-parallel
engine, and the activations one block keeps for the backward (docs/parallelism.md §11-12).
Pure arithmetic on a config: no process, device or tensor.
"""

from __future__ import annotations

from lctrain.config import LctrainConfig, ModelConfig, derive

STATE_BYTES_PER_PARAM = 16
"""fp32 master weight, its gradient and the two AdamW moments."""


def param_count(m: ModelConfig) -> int:
    """Parameters of the Llama of `m` (a tied output layer counted once)."""
    head_dim = m.dim // m.n_heads
    attn = m.dim * head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    block = attn + 3 * m.dim * m.ffn_dim + 2 * m.dim
    head = 0 if m.tie_embeddings else m.vocab_size * m.dim
    return m.vocab_size * m.dim + m.n_layers * block + m.dim + head


def local_params(cfg: LctrainConfig) -> tuple[int, int]:
    """(block parameters, root parameters) one rank holds before FSDP: TP shards the matmuls,
    the embedding and the output layer and replicates the norms; a stage holds n_layers / pp
    blocks (the root counted whole: embedding, final norm and an untied output layer)."""
    m, p = cfg.model, cfg.parallel
    head_dim = m.dim // m.n_heads
    matmuls = m.dim * head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.dim * m.ffn_dim
    blocks = m.n_layers // p.pp * (matmuls // p.tp + 2 * m.dim)
    vocab = m.vocab_size * m.dim // p.tp
    return blocks, vocab * (1 if m.tie_embeddings else 2) + m.dim


def state_bytes_per_rank(cfg: LctrainConfig, world_size: int) -> float:
    """Weights, gradients and AdamW moments one rank holds: TP and PP split the model; FSDP also
    shards it over dp x cp, DDP replicates it there."""
    d, p = derive(cfg, world_size), cfg.parallel
    local = STATE_BYTES_PER_PARAM * sum(local_params(cfg))
    return local / (d.dp * p.cp) if p.dp_engine == "fsdp" else local


def activation_formula(cfg: LctrainConfig, world_size: int, batch: int) -> float:
    """Bytes one block keeps for the backward on one rank, float32 (no autocast); derived op by
    op in docs/parallelism.md §11 and exact against `lctrain.parallel.memory` measurements.

    n = batch * S / cp local tokens; t = tp; s = t with SP, else 1; D, F model and SwiGLU
    widths, D_kv = H_kv * d, H heads, r KV replication (Ulysses). Per token, in elements:
      none:      2 (D + 1)/s + 2 D + 2 D/s + (2 D + 2 r D_kv + H + 4 F)/t  [+ D/t Ulysses/USP]
                 norms (rsqrt, normalised x on the sequence shard; the (gathered) norm output
                 kept by the column-parallel matmuls), residual stream and block output, then
                 q, k, v, attention output, lse and the four SwiGLU tensors on the TP shard.
                 All-gather KV keeps the gathered K/V: 2 D_kv (cp - 1)/t more.
      selective: (D + 2 D_kv + 2 F)/t + 2 D + D/s  (matmul outputs, before any KV
                 replication; the two row-parallel partial sums at full width; the block output),
                 plus (D + H)/t for the attention output and lse when cp = 1 (context-parallel
                 attention is recomputed instead).
      full:      D/s (the block output only: the next block's checkpointed input).
    """
    m, p = cfg.model, cfg.parallel
    dv = derive(cfg, world_size)
    n = batch * cfg.train.seq_len // p.cp
    D, F, H, hd = m.dim, m.ffn_dim, m.n_heads, m.dim // m.n_heads
    t, r = p.tp, dv.kv_replication
    s = t if (p.sp and t > 1) else 1
    dkv = m.n_kv_heads * hd
    ulysses = p.cp > 1 and p.attention in ("ulysses", "usp")
    mode = cfg.train.activation_checkpointing
    if mode == "full":
        return 4.0 * n * D / s
    if mode == "selective":  # local attention: its output and lse are kept too
        attention = n * H * (hd + 1) / t if p.cp == 1 else 0.0
        return 4.0 * (n * ((D + 2 * dkv + 2 * F) / t + 2 * D + D / s) + attention)
    per_token = 2 * (D + 1) / s + 2 * D + 2 * D / s + (2 * D + 2 * r * dkv + H + 4 * F) / t
    if ulysses:
        per_token += D / t
    if p.cp > 1 and p.attention == "allgather":
        per_token += 2 * dkv * (p.cp - 1) / t
    return 4.0 * n * per_token
