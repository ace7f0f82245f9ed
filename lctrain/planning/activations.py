"""What a step's forward keeps for the backward and what the backward holds for a moment: one
block's activations per recompute mode, derived op by op and exact against measurement (fp32
and bf16; a mixture of experts' own), the rest of the model's (final norm, RoPE tables, loss
head), the attention's host plans, its context-parallel buffers, and the backward's working
set, an estimate (docs/parallelism.md §11, §16, §28). Pure arithmetic on a config.
"""

from __future__ import annotations

import dataclasses

from lctrain.config import LctrainConfig, ModelConfig, derive
from lctrain.config.derived import dtype_bytes, load_balance_of
from lctrain.config.load_balances import split_of
from lctrain.config.model_families import NORM_TILE_ELEMENTS, model_family
from lctrain.config.model_parts import EXPERT_BIAS, OUTPUT_GATE, QK_NORM
from lctrain.config.model_size import (
    DELTA_CHUNK,
    expert_params,
    layer_kinds,
    linear_mixer_params,
    mlp_params,
)
from lctrain.planning.cp_costs import LayerShape, MemoryTerms, cp_costs
from lctrain.planning.documents import travelling_share


def attention_buffer_bytes(cfg: LctrainConfig, world_size: int, batch: int) -> float:
    """Device bytes a context-parallel attention layer holds for a moment beyond what the block
    keeps (docs/parallelism.md §16), at its peak, the backward: the algorithm's
    `MemoryTerms.buffers`:
      - ring (and USP's ring over cp_ring ranks): the K/V block arriving while the held one is
        computed, [B, S/cp_ring, k H_kv/(tp u), d] x 2 in the compute dtype, and the float32
        accumulators dQ [B, S/cp_ring, H/(tp u), d] and three dK/dV pairs (the rank's own, the
        one being sent, the one arriving);
      - all-gather KV: the gradients of the gathered K and V, [B, S, H_kv/tp, d] x 2 in the
        compute dtype, before their reduce-scatter;
      - Ulysses' all-to-all buffers are not modelled (0; `MemoryTerms.unmodelled`)."""
    if cfg.parallel.cp == 1:
        return 0.0
    return cp_costs(cfg.parallel.attention).memory.buffers(
        layer_shape(cfg, world_size, batch))


def layer_shape(cfg: LctrainConfig, world_size: int, batch: int) -> LayerShape:
    """One attention layer of `batch` sequences on one rank, as the registry's memory formulas
    read it."""
    m, p, d = cfg.model, cfg.parallel, derive(cfg, world_size)
    return LayerShape(batch=batch, seq_len=cfg.train.seq_len, cp=p.cp, ulysses=d.cp_ulysses,
                      tp=p.tp, dim=m.q_dim, heads=m.n_heads, kv_heads=m.n_kv_heads,
                      kv_replication=d.kv_replication,
                      compute_bytes=dtype_bytes(cfg, world_size)[0])


def _norm_bytes(D: int, s: int, a: int, r: int) -> float:
    """Bytes per token one RMSNorm keeps: its input (the residual stream) and the float32
    rsqrt on the sequence shard, and its output in the compute dtype, gathered over the
    sequence under SP (the matmuls keep it). lctrain's norm recomputes the rest in its backward
    (`models.norms.RMSNorm`)."""
    return (r * D + 4) / s + a * D


def _head_norm_bytes(m: ModelConfig, a: int) -> float:
    """Bytes per token the Q and K head norms of a `qk_norm` family (Qwen3) keep beyond what
    the block keeps without them, on all heads (divide by tp): each norm keeps its input, the
    projection's output in the compute dtype, and the float32 rsqrt per head; its output
    replaces the projection's output as RoPE's input: a W + 4 heads, with W = D_q for Q and
    D_kv for K (before any KV replication)."""
    return a * (m.q_dim + m.kv_dim) + 4 * (m.n_heads + m.n_kv_heads)


def activation_formula(cfg: LctrainConfig, world_size: int, batch: int,
                       layer: int = 0) -> float:
    """Bytes one block keeps for the backward on one rank (its input included, wherever the
    backward keeps it: on the device, or on the host under train.offload_activations); derived
    op by op in docs/parallelism.md §11 and exact against `lctrain.tracing.measure`
    measurements, fp32 and bf16.

    n = batch * S / cp local tokens; t = tp; s = t with SP, else 1; D, F model and SwiGLU
    widths, D_q = H * d the queries' width (D unless model.head_dim says otherwise), D_kv =
    H_kv * d, H heads, k KV replication (Ulysses); a, r, casts: `dtype_bytes`;
    N = (r D + 4)/s + a D, one norm (`_norm_bytes`). Per token, in bytes:
      none:      2 N + a (2 D_q + 2 k D_kv + 4 F)/t + 4 H/t  [+ a D_q/t Ulysses/USP]
                 the two norms, then q, k, v, the attention output, its fp32 lse and the four
                 SwiGLU tensors on the TP shard; a qk_norm family's head norms
                 (a (D_q + D_kv) + 4 (H + H_kv))/t (`_head_norm_bytes`); an output_gate
                 family's gate 3 a D_q/t (the gate's half of the query projection, its
                 sigmoid, the gated output); at cp > 1 what
                 the algorithm keeps besides
                 (its registry entry's `kept_per_token`): Ulysses' and USP's output copy a D_q/t,
                 all-gather KV's gathered K/V a 2 D_kv (cp - 1)/t. With casts, per block (not per token), a bf16 copy of
                 every matmul weight: a W/t. train.mlp_chunk: the FFN keeps its chunks' inputs
                 (a copy of the norm output, which it no longer keeps itself) instead of
                 a 4 F/t, and no copy of its weights; plus each chunk's int64 token index
                 (8 S/cp bytes per block).
      selective: a ((D_q + 2 D_kv + 2 F)/t + 2 D) + r D/s  (matmul outputs, before any KV
                 replication; the two row-parallel partial sums at full width; the block input),
                 plus (a D_q + 4 H)/t for the attention output and lse when cp = 1 (context-parallel
                 attention is recomputed instead; with an output gate the gate's sigmoid too,
                 a D_q/t).
      full:      r D/s (the block input only).
    A mixture-of-experts layer (`layer`) keeps its own MLP part instead (`_moe_kept`); tiled,
    the same as a tiled dense MLP. At cp = 1 without documents, a layer whose attention runs
    the position-aware kernels (a window shorter than the sequence, or sinks) keeps their int64
    positions, 8 S bytes per block.
    """
    m, p = cfg.model, cfg.parallel
    dv = derive(cfg, world_size)
    a, r, casts = dtype_bytes(cfg, world_size)
    n = batch * cfg.train.seq_len // p.cp
    D, F, H, hd, Dq = m.dim, m.ffn_dim, m.n_heads, m.d_head, m.q_dim
    t, k = p.tp, dv.kv_replication
    s = t if (p.sp and t > 1) else 1
    dkv = m.kv_dim
    mode = cfg.train.activation_checkpointing
    moe = m.is_moe_layer(layer)
    if mode == "full":
        return n * r * D / s
    if m.is_linear_layer(layer):
        return _linear_block_kept(cfg, n, a, r, s, layer, casts)
    gate = model_family(m.family).has(OUTPUT_GATE)
    if mode == "selective":  # local attention: its output and lse are kept too
        attention = n * (a * Dq * (2 if gate else 1) + 4 * H) / t if p.cp == 1 else 0.0
        mlp = _moe_kept(cfg, n, a, mode) if moe else n * a * (2 * F / t + D)
        return n * (a * ((Dq + 2 * dkv) / t + D) + r * D / s) + attention + mlp
    attention_weights = D * hd * (2 * H + 2 * m.n_kv_heads + (H if gate else 0)) // t
    mlp_weights = _mlp_weights(cfg, layer)
    per_token = 2 * _norm_bytes(D, s, a, r) + a * (2 * Dq + 2 * k * dkv) / t + 4 * H / t
    if model_family(m.family).has(QK_NORM):
        per_token += _head_norm_bytes(m, a) / t
    if gate:  # the gate's half of the query projection, its sigmoid and the gated output
        per_token += 3 * a * Dq / t
    if p.cp > 1:  # what the algorithm keeps besides (`MemoryTerms.kept_per_token`)
        per_token += cp_costs(p.attention).memory.kept_per_token(
            layer_shape(cfg, world_size, batch))
    # (the position-aware kernels' positions are the micro-batch's host block, made once: none
    # per layer)
    if cfg.train.mlp_chunk:
        per_block = 8 * cfg.train.seq_len // p.cp + (a * attention_weights if casts else 0)
        return n * per_token + per_block
    per_block = a * (attention_weights + mlp_weights) if casts else 0
    mlp = _moe_kept(cfg, n, a, mode) if moe else n * a * 4 * F / t
    return n * per_token + mlp + per_block


def _mlp_weights(cfg: LctrainConfig, layer: int) -> float:
    """The weights of block `layer`'s MLP one rank multiplies by: the gated MLP's TP shard, or
    a mixture of experts' router, shared expert and the experts of its ep rank."""
    m, p = cfg.model, cfg.parallel
    if not m.is_moe_layer(layer):
        return 3 * m.dim * m.ffn_dim // p.tp
    return mlp_params(m, layer) - expert_params(m, layer) + expert_params(m, layer) // p.ep


def _linear_block_kept(cfg: LctrainConfig, n: int, a: int, r: int, s: int,
                       layer: int, casts: bool) -> float:
    """Bytes a linear-attention block keeps for the backward over n tokens: its two norms, its
    MLP (as an attention block's; selective checkpointing keeps what `none` keeps), the
    mixer's (`linear_mixer_kept`) and, with casts, the bf16 copies of the weights its matmuls
    take (the mixer's projections and the MLP's, per block). An estimate within a few percent
    of the torch path's measurement (tests/test_activation_memory.py), not exact as the
    attention blocks' are."""
    m, p = cfg.model, cfg.parallel
    mlp = _moe_kept(cfg, n, a, "none") if m.is_moe_layer(layer) else n * a * 4 * m.ffn_dim / p.tp
    sharded = linear_mixer_params(m)[0]  # all but the convolution's kernel, dt_bias and A_log
    projections = (sharded - m.linear_conv_channels * m.linear_conv_kernel
                   - 2 * m.linear_value_heads) / p.tp
    weights = a * (projections + _mlp_weights(cfg, layer)) if casts else 0
    return n * 2 * _norm_bytes(m.dim, s, a, r) + mlp + n * linear_mixer_kept(cfg, a) + weights


def linear_mixer_kept(cfg: LctrainConfig, a: int) -> float:
    """Bytes per token a Gated DeltaNet mixer keeps for the backward on the torch path
    (lctrain.attention.delta_rule; docs/parallelism.md §31), per value head H_v of d_k, d_v,
    conv channels C_c, kernel k, chunks of C tokens. The convolution multiplies its
    compute-dtype input by float32 weights, and the recurrence runs in float32 also under
    autocast, so most of what they keep is float32 in either dtype:
      the convolution: its input and its k - 1 shifted copies, k a C_c (each copy s tokens
      longer: k (k - 1) / 2 rows more per sequence of S_l), and its float32 sum and SiLU,
      8 C_c;
      the chunk matrices (K K^T, Q K^T, the triangular system's inverse and two masked
      products), 4 x 5 C, and a boolean mask, C;
      Q and K's side: 12 float32 tensors of d_k (Q and K repeated to H_v heads, normalised and
      scaled, K β, the decayed keys the solve takes, its W, the queries and keys that read and
      write the state);
      V's side: 8 tensors of d_v counted at 4 bytes (V, V β, the solve's U, the output, the
      gated norm's float32 input, its normalised values and its float32 gate and SiLU: a few
      of them bf16 under bf16);
      per head scalars (beta, the decay and its cumulative sums, the norm's rsqrt), 4 x 12;
      the state per chunk, 4 d_k d_v / C.
    An estimate, over the measurement by under 2% at Qwen3.5's d_k = d_v = 128 (tests/
    test_activation_memory.py): it leaves out only that with as many key as value heads Q and
    K are not repeated. Under context parallelism by state passing the recurrence runs twice,
    from zero for the stretch's final state and transition, then from its exact initial state:
    the first pass keeps about half of what the second does (what the state and the transition
    need, not the output), so its terms (all but the convolution's) count 1.5 times; the head
    split runs it once over whole rows for 1/cp of the heads, the same bytes as one rank's
    tokens for all of them. A stretch shorter than a
    chunk is padded to one (the formula assumes stretches of whole chunks: S / (2 cp) >= C
    under zigzag)."""
    m, p = cfg.model, cfg.parallel
    hv, dk, dv, c = m.linear_value_heads, m.linear_key_dim, m.linear_value_dim, DELTA_CHUNK
    channels = m.linear_conv_channels
    k, local = m.linear_conv_kernel, cfg.train.seq_len // p.cp
    conv = (a * k * (1 + (k - 1) / (2 * local)) + 8) * channels
    rule = hv * (4 * 5 * c + c + 4 * 12 * dk + 4 * 8 * dv + 4 * 12 + 4 * dk * dv / c)
    twice = p.cp > 1 and p.linear_cp == "state"
    return (conv + rule * (1.5 if twice else 1)) / p.tp


def _moe_kept(cfg: LctrainConfig, n: int, a: int, mode: str) -> float:
    """Bytes a mixture-of-experts MLP keeps for the backward over n tokens (docs/parallelism.md
    §28), its N k rows computed by experts (exact without expert parallelism; the mean over the
    ep ranks with it: each rank computes the rows its experts received):
      none:      per token, a (k D + k) (the weighted rows, their weights), a k D more under ep
                 (the rows back from the combine), 4 E (the float32 probabilities), 24 k (the
                 int64 top-k indices, sort order and row tokens) and, with norm_topk_prob,
                 4 k + 4 (the top-k values and their sum); per row a (4 F_e + 2 D) (the
                 expert's input and output, gate, activation, up and product; GPT-OSS's
                 biased, clamped SwiGLU a (7 F_e + 2 D) and 8 for each row's expert) and 8
                 under ep (the order of the received rows);
      selective: the matmul outputs, a (2 F_e + D) per row and a E per token (the router).
    A shared expert of width F_s keeps per token what a dense MLP keeps, a 4 F_s (selective:
    its matmuls' outputs, a (2 F_s + D)), and its gate's: the sigmoid and the expert's output
    it scales, a (1 + D) (selective: the gate's matmul output, a)."""
    m, ep = cfg.model, cfg.parallel.ep > 1
    k, E, D, F = m.experts_per_token, m.n_experts, m.dim, m.expert_dim
    rows = n * k
    shared = 0.0
    if m.shared_expert_ffn_dim is not None:
        width = m.shared_expert_ffn_dim
        shared = n * a * ((2 * width + D + 1) if mode == "selective" else (4 * width + D + 1))
    if mode == "selective":
        return rows * a * (2 * F + D) + n * a * E + shared
    biased = model_family(m.family).has(EXPERT_BIAS)
    token = (a * (k * D * (2 if ep else 1) + k) + 4 * E + 24 * k
             + (4 * k + 4 if m.norm_topk_prob else 0))
    row = a * ((7 if biased else 4) * F + 2 * D) + (8 if biased else 0) + (8 if ep else 0)
    return n * token + rows * row + shared


def head_activation_formula(cfg: LctrainConfig, world_size: int, batch: int) -> float:
    """Bytes the rest of the model keeps for the backward on one rank (docs/parallelism.md §11):
    the final norm (its input is the last block's output), the RoPE tables, the fp32
    log-softmax of the [n, V/tp] logits (none under train.loss_chunk: each chunk's logits are
    computed again in the backward), the int64 labels (a second copy under TP's vocab-parallel
    loss), the loss scalars, and with casts the bf16 copy of the output weight."""
    m, p = cfg.model, cfg.parallel
    a, r, casts = dtype_bytes(cfg, world_size)
    n = batch * cfg.train.seq_len // p.cp
    t = p.tp
    s = t if (p.sp and t > 1) else 1
    total = (n * _norm_bytes(m.dim, s, a, r) + rope_table_bytes(cfg, world_size, batch)
             + 8 * n * (2 if t > 1 else 1))
    if cfg.train.loss_chunk:
        return total + 4  # the running sum of the chunk losses
    total += 4 * n * m.vocab_size / t + 8  # log-softmax; loss and its total weight
    return total + (a * m.vocab_size * m.dim / t if casts else 0)


def rope_table_bytes(cfg: LctrainConfig, world_size: int, batch: int) -> float:
    """The RoPE cos and sin tables of one forward, [rows, S/cp, d] in the compute dtype (one row
    per sequence under document masking): part of `head_activation_formula`; under pipelining
    every stage computes and keeps its own."""
    rows = (batch if cfg.data.document_masking else 1) * cfg.train.seq_len // cfg.parallel.cp
    return 2 * rows * cfg.model.rotary_dim * dtype_bytes(cfg, world_size)[0]


def planning_bytes(cfg: LctrainConfig, batch: int) -> float:
    """Host bytes the attention's call plans keep during a forward, planned in the first block
    for all of them (CPU tensors: device memory only in a CPU run): the int64 document ids of
    the attention blocks (packed documents: `MemoryTerms.block_tokens`, every token once for
    the registered algorithms); for an algorithm that `sorts_positions`
    (Ulysses and USP) over zigzag shards the position order of the tokens it attends over (sort
    index, inverse and sorted positions) and the document ids again in that order; with a split
    per row (load_balance=documents) the blocks' positions, one int64 per row and token (each
    group's tokens are then in position order already: nothing is sorted); and what of the key
    blocks travels (`MemoryTerms.travel_plans`, at the corpus's travelling share, §24; without
    documents all-gather KV's key block of every token)."""
    p, S = cfg.parallel, cfg.train.seq_len
    terms = cp_costs(p.attention).memory if p.cp > 1 else MemoryTerms()
    split = split_of(load_balance_of(cfg)) if p.cp > 1 else None
    sorts = terms.sorts_positions and split is not None and not split.group_in_order
    tokens = terms.block_tokens(batch * S, p.cp)
    total = 8 * tokens * (2 if sorts else 1) if cfg.data.document_masking else 0
    if sorts:
        total += 24 * S  # three int64 tensors of S: sort index, inverse, sorted positions
    if split is not None and split.per_row:
        total += 8 * tokens
    share = travelling_share(cfg) if cfg.data.document_masking else None
    return total + terms.travel_plans(batch, S, p.cp, share)


def working_bytes(cfg: LctrainConfig, world_size: int, batch: int,
                  loss_head: bool = True) -> float:
    """Device bytes the backward holds for a moment beyond what the forward kept: an estimate
    (bench/activation_memory.py compares it with measured peaks), the larger of (the second
    only on a rank with the `loss_head`, the last pipeline stage)
      - one block's backward: the block recomputed (what it keeps without checkpointing, less
        what its mode kept), the fp32 gradients of its input and output (2 x 4 n D/s), the
        RMSNorm backward's five float32 working tensors of one row tile (at most
        `NORM_TILE_ELEMENTS` each), and under train.offload_activations its input, back from
        the host;
      - the loss head's backward: for the logits of one chunk (train.loss_chunk; else of all n
        tokens), [rows, V/tp], their gradient in fp32 and in the compute dtype (without TP
        first two fp32 gradients at once: the log-probabilities' and the logits'), with tiling
        the recomputed logits and log-softmax (compute dtype and fp32), and under offload
        what the head kept, back from the host."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    a, r, _ = dtype_bytes(cfg, world_size)
    n = batch * t.seq_len // p.cp
    s = p.tp if (p.sp and p.tp > 1) else 1
    recompute = 0.0
    if t.activation_checkpointing != "none":
        plain = dataclasses.replace(cfg, train=dataclasses.replace(
            t, activation_checkpointing="none"))
        recompute = max(activation_formula(plain, world_size, batch, i)
                        - activation_formula(cfg, world_size, batch, i)
                        for i, _ in layer_kinds(m, range(m.n_layers)))
    block = recompute + 2 * 4 * n * m.dim / s + 5 * 4 * min(n * m.dim / s, NORM_TILE_ELEMENTS)
    rows = batch * min(t.loss_chunk, t.seq_len // p.cp) if t.loss_chunk else n
    # the cross-entropy's backward: the fp32 gradient of the log-probabilities and of the
    # logits at once (8 bytes; torch's vocab-parallel loss fuses the two: 4), then the fp32
    # gradient and its copy in the compute dtype (4 + a)
    grads = max(4 + a, 8) if p.tp == 1 else 4 + a
    head = rows * m.vocab_size / p.tp * (grads + ((4 + a) if t.loss_chunk else 0))
    if t.offload_activations:
        block += r * n * m.dim / s
        head += head_activation_formula(cfg, world_size, batch)
    return max(block, head) if loss_head else block
