"""Memory formulas per rank: parameters, weights + gradients + optimizer state per data-parallel
engine, FSDP's gathered weights, the activations one block and the rest of the model keep for
the backward (exact against measurement), and the backward's working set (an estimate)
(docs/parallelism.md §11-12). Under pipeline parallelism each figure is that of one pipeline
rank (`pp_rank`): its stages' blocks, the embedding on the rank of the first stage, the final
norm and output layer on the rank of the last, the micro-batches its stages keep in flight
and the buffers torch's pipeline stages receive into (docs/parallelism.md §13). Pure
arithmetic on a config: no process, device or tensor.
"""

from __future__ import annotations

import dataclasses
from functools import cache

from lctrain.config import LctrainConfig, ModelConfig, derive
from lctrain.config.cp_algorithms import LayerShape, MemoryTerms, cp_algorithm
from lctrain.config.derived import (
    data_parallel_engine_of,
    load_balance_of,
    reduces_each_micro_step,
)
from lctrain.config.model_families import NORM_TILE_ELEMENTS, model_family
from lctrain.config.model_size import (
    block_params,
    block_split,
    expert_params,
    layer_kinds,
    mlp_params,
)
from lctrain.layout.stages import (
    rank_of,
    rank_stages,
    split_layers,
    stage_count,
    stages_of,
)
from lctrain.planning.documents import travelling_share


def compute_bytes(cfg: LctrainConfig) -> int:
    """Bytes of one element in the compute dtype (train.dtype): 2 for bf16, else 4."""
    return 2 if cfg.train.dtype == "bf16" else 4


def param_count(m: ModelConfig) -> int:
    """Parameters of the model of `m` (a tied output layer counted once)."""
    head = 0 if m.tie_embeddings else m.vocab_size * m.dim
    blocks = sum(n * block_params(m, i) for i, n in layer_kinds(m, range(m.n_layers)))
    return m.vocab_size * m.dim + blocks + m.dim + head


def active_param_count(m: ModelConfig) -> int:
    """Parameters one token's forward multiplies by: `param_count` with only k experts of each
    mixture of experts (the same for a dense model)."""
    return param_count(m) - sum(block_params(m, i) - block_params(m, i, active=True)
                                for i in range(m.n_layers) if m.is_moe_layer(i))


def local_params(cfg: LctrainConfig, pp_rank: int = 0) -> tuple[int, int]:
    """(block parameters, root parameters) pipeline rank `pp_rank` holds before FSDP: TP shards
    the matmuls, the embedding and the output layer and replicates the norms; the rank holds
    the blocks of its stages, the embedding if it runs the first stage, the final norm and an
    untied output layer, or a tied one's copy under pp > 1, if it runs the last."""
    m, p = cfg.model, cfg.parallel
    stages, mine = split_layers(cfg), stages_of(cfg, pp_rank)
    layers = [i for s in mine for i in stages[s]]
    blocks = sum(n * (block_split(m, i)[0] // p.tp + block_split(m, i)[1])
                 for i, n in layer_kinds(m, layers))
    vocab = m.vocab_size * m.dim // p.tp
    root = vocab if 0 in mine else 0
    if len(stages) - 1 in mine:
        root += m.dim + (0 if m.tie_embeddings and p.pp == 1 else vocab)
    return blocks, root


def tied_copy_params(cfg: LctrainConfig, pp_rank: int = 0) -> int:
    """Elements of the tied embedding's copy that pipeline rank `pp_rank` holds in its last
    stage's output layer (docs/parallelism.md §27), before FSDP: counted by `local_params`,
    without AdamW moments."""
    m, p = cfg.model, cfg.parallel
    last = len(split_layers(cfg)) - 1
    if not m.tie_embeddings or p.pp == 1 or last not in stages_of(cfg, pp_rank):
        return 0
    return m.vocab_size * m.dim // p.tp


def stage_params(cfg: LctrainConfig, stage: int) -> int:
    """Parameters of pipeline stage `stage`, whole (all TP shards): summed over the stages,
    `param_count`."""
    m, stages = cfg.model, split_layers(cfg)
    total = sum(n * block_params(m, i) for i, n in layer_kinds(m, stages[stage]))
    if stage == 0:
        total += m.vocab_size * m.dim
    if stage == len(stages) - 1:
        total += m.dim + (0 if m.tie_embeddings else m.vocab_size * m.dim)
    return total


def state_bytes_per_rank(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> float:
    """Weights, gradients and AdamW moments one rank of pipeline rank `pp_rank` keeps on its
    device: the sum of `state_parts` (docs/parallelism.md §9, §12)."""
    return sum(state_parts(cfg, world_size, pp_rank).values())


def state_parts(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> dict[str, float]:
    """The state one rank keeps on its device, itemised: "weights", "gradients" and
    "optimizer_state" (the AdamW moments). TP and PP split the model; FSDP shards all three
    over dp x cp (4 + 4 + 8 bytes per parameter), DDP replicates them there. DeepSpeed, as
    bench/engines.py measures it: the model's weights in the compute dtype (whole under
    ZeRO-1/2, a 1/n partition under ZeRO-3) plus an fp32 master partition; gradients whole under
    ZeRO-1, a partition under ZeRO-2/3; parts offloaded to the host count 0. Without a
    data-parallel engine (one rank of dp x cp) under TP, the vocab-parallel embedding's gradient
    is the whole table on every TP rank (torch's row-wise embedding returns it replicated; FSDP
    would reshard it)."""
    d, p = derive(cfg, world_size), cfg.parallel
    params, n = sum(local_params(cfg, pp_rank)), d.dp * p.cp
    optimized = params - tied_copy_params(cfg, pp_rank)  # what AdamW keeps moments for
    engine = data_parallel_engine_of(cfg, world_size)
    moments = 0.0 if p.offload_state == "optimizer" else 1.0  # HostAdamW keeps them
    if engine == "fsdp":
        on_device = 0.0 if p.offload_state == "optimizer+params" else 1.0
        return {"weights": on_device * 4 * params / n, "gradients": on_device * 4 * params / n,
                "optimizer_state": on_device * moments * 8 * optimized / n}
    if engine != "deepspeed":  # DDP, or one rank of dp x cp: the rank's E/ep experts whole
        elsewhere = _experts_elsewhere(cfg, pp_rank)
        params, optimized = params - elsewhere, optimized - elsewhere
        extra = _whole_embedding_extra(cfg, pp_rank) if n == 1 else 0
        return {"weights": 4 * params, "gradients": 4 * params + extra,
                "optimizer_state": moments * 8 * optimized}
    ds, a = cfg.deepspeed, compute_bytes(cfg)
    offload = ds.offload_optimizer == "cpu"
    weights = 0 if ds.offload_param == "cpu" else a * params / (n if ds.zero_stage == 3 else 1)
    return {"weights": weights + (0.0 if offload else 4 * params / n),
            "gradients": 0.0 if offload else 4 * params / (n if ds.zero_stage >= 2 else 1),
            "optimizer_state": 0.0 if offload else 8 * params / n}


def _experts_elsewhere(cfg: LctrainConfig, pp_rank: int) -> int:
    """Expert parameters that `local_params` counts for pipeline rank `pp_rank` but other ranks
    of its ep group hold: it counts a 1/tp share of every expert with the TP-sharded
    matrices, and the rank holds E/ep whole experts (expert parallelism spans the TP ranks and
    never splits an expert), so 1/tp - 1/ep of them (negative when ep < tp)."""
    m, p = cfg.model, cfg.parallel
    layers = [i for s in stages_of(cfg, pp_rank) for i in split_layers(cfg)[s]]
    experts = sum(n * expert_params(m, i) for i, n in layer_kinds(m, layers))
    return experts // p.tp - experts // p.ep


def _whole_embedding_extra(cfg: LctrainConfig, pp_rank: int) -> int:
    """Bytes by which the vocab-parallel embedding's fp32 gradient exceeds its TP shard on a
    rank of the first stage: torch's row-wise embedding returns the whole table's gradient on
    every TP rank (0 without TP)."""
    m, p = cfg.model, cfg.parallel
    if p.tp == 1 or 0 not in stages_of(cfg, pp_rank):
        return 0
    return 4 * m.vocab_size * m.dim * (p.tp - 1) // p.tp


def accumulated_grad_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> float:
    """Gradients that gradient accumulation keeps beside the state's (docs/parallelism.md §9,
    §29): the micro-steps before the last run without gradient sync, so
      - FSDP keeps every unit's whole (TP-local, E/ep experts) gradient in fp32, the reduce
        dtype, from the first micro-step's backward to the last one's reduce-scatter, the
        vocab-parallel embedding's whole table (`_whole_embedding_extra`);
      - DDP's gradients of those micro-steps are tensors of their own until the last one's
        backward copies them into its buckets (of which the gradients are then views).
    4 bytes per local parameter; 0 without accumulation, without a data-parallel engine, under
    DeepSpeed, or when gradients are reduced every micro-step (parallel.offload_state=
    optimizer+params)."""
    d = derive(cfg, world_size)
    engine = data_parallel_engine_of(cfg, world_size)
    if engine not in ("fsdp", "ddp") or d.grad_accum == 1 or reduces_each_micro_step(cfg):
        return 0.0
    params = sum(local_params(cfg, pp_rank)) - tied_copy_params(cfg, pp_rank)
    extra = _whole_embedding_extra(cfg, pp_rank) if engine == "fsdp" else 0
    return 4 * (params - _experts_elsewhere(cfg, pp_rank)) + extra


def host_state_parts(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> dict[str, float]:
    """The state one rank keeps in host memory (docs/parallelism.md §22), itemised like
    `state_parts`: under parallel.offload_state=optimizer+params FSDP's fp32 shards, their
    gradients and AdamW moments, 4 + 4 + 8 bytes per parameter / (dp x cp); under
    optimizer, HostAdamW's weight and gradient buffers and the moments, 4 + 4 + 8 bytes per
    parameter the rank holds (a 1/(dp x cp) shard under FSDP, all of them otherwise); with the
    DeepSpeed engine, what its offload keys move (an estimate: fp32 master partition, moments
    and gradient partition, 4 + 8 + 4 bytes per parameter / (dp x cp); ZeRO-3's weights in the
    compute dtype / (dp x cp)). Empty when nothing is offloaded."""
    p = cfg.parallel
    engine = data_parallel_engine_of(cfg, world_size)
    if p.offload_state == "none" and engine != "deepspeed":
        return {}
    d = derive(cfg, world_size)
    params, n = sum(local_params(cfg, pp_rank)), d.dp * p.cp
    if engine == "deepspeed":
        ds, out = cfg.deepspeed, {}
        if ds.offload_optimizer == "cpu":
            out = {"weights": 4 * params / n, "gradients": 4 * params / n,
                   "optimizer_state": 8 * params / n}
        if ds.offload_param == "cpu":
            out["weights"] = out.get("weights", 0.0) + compute_bytes(cfg) * params / n
        return out
    params -= tied_copy_params(cfg, pp_rank)  # on the device: the optimizer never sees it
    local = params / n if engine == "fsdp" else params
    return {"weights": 4 * local, "gradients": 4 * local, "optimizer_state": 8 * local}


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
    return cp_algorithm(cfg.parallel.attention).memory.buffers(
        layer_shape(cfg, world_size, batch))


def layer_shape(cfg: LctrainConfig, world_size: int, batch: int) -> LayerShape:
    """One attention layer of `batch` sequences on one rank, as the registry's memory formulas
    read it."""
    m, p, d = cfg.model, cfg.parallel, derive(cfg, world_size)
    return LayerShape(batch=batch, seq_len=cfg.train.seq_len, cp=p.cp, ulysses=d.cp_ulysses,
                      tp=p.tp, dim=m.q_dim, heads=m.n_heads, kv_heads=m.n_kv_heads,
                      kv_replication=d.kv_replication,
                      compute_bytes=dtype_bytes(cfg, world_size)[0])


ALLOCATOR_FRACTION = 0.10
"""The allocator allowance on top of the modelled bytes: 10% of them (the caching allocator's
block rounding and fragmentation) ..."""
ALLOCATOR_FIXED_GIB = 1.0
"""... plus 1 GiB (the CUDA context, NCCL's and the kernels' workspaces: outside any formula)."""


def allocator_allowance(modelled_bytes: float) -> float:
    """Bytes the plan adds to a rank's modelled total: ALLOCATOR_FRACTION of it plus
    ALLOCATOR_FIXED_GIB GiB (a stated allowance, not a measurement)."""
    return ALLOCATOR_FRACTION * modelled_bytes + ALLOCATOR_FIXED_GIB * 2**30


def gathered_weight_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> float:
    """FSDP's gathered (unsharded) weights at the peak of a step, in bf16 under
    train.dtype=bf16; 0 without FSDP. Without pipelining: the root's (embedding, final norm,
    output layer: kept from the forward to the backward) and two blocks' (the one computing and
    the one prefetched). Under pp > 1 all of the rank's: torch's pipeline stages turn off
    resharding after the backward until the step's last one (`backward_maybe_with_nosync`),
    so a stage stays gathered from its backward to its next forward, and the multi-stage
    schedules gather whole stages ahead (`_add_unshard_reshard`; docs/parallelism.md §13)."""
    if data_parallel_engine_of(cfg, world_size) != "fsdp":
        return 0.0
    blocks, root = local_params(cfg, pp_rank)
    if cfg.parallel.pp == 1:
        blocks = 2 * max(_gathered_block(cfg, i)
                         for i, _ in layer_kinds(cfg.model, range(cfg.model.n_layers)))
    return (blocks + root) * compute_bytes(cfg)


def _gathered_block(cfg: LctrainConfig, layer: int) -> int:
    """Parameters FSDP gathers for block `layer` on one rank: its TP shard, and of a mixture of
    experts' matrices (not split by TP) the rank's E/ep experts (docs/parallelism.md §28)."""
    m, p = cfg.model, cfg.parallel
    sharded, replicated = block_split(m, layer)
    experts = expert_params(m, layer)
    return (sharded - experts) // p.tp + experts // p.ep + replicated


def dtype_bytes(cfg: LctrainConfig, world_size: int) -> tuple[int, int, bool]:
    """(a, r, casts) of docs/parallelism.md §11: bytes per element of what the matmuls and
    attention compute (2 under bf16 autocast), bytes per element of the residual stream (2 only
    when FSDP computes with bf16 weights: the embedding then outputs bf16; autocast on fp32
    weights keeps it fp32), and whether each matmul keeps a bf16 copy of its fp32 weight
    (autocast without FSDP's bf16 weights)."""
    bf16 = cfg.train.dtype == "bf16"
    fsdp_bf16 = bf16 and data_parallel_engine_of(cfg, world_size) == "fsdp"
    return (2 if bf16 else 4), (2 if fsdp_bf16 else 4), bf16 and not fsdp_bf16


def _norm_bytes(D: int, s: int, a: int, r: int) -> float:
    """Bytes per token one RMSNorm keeps: its input (the residual stream) and the float32
    rsqrt on the sequence shard, and its output in the compute dtype, gathered over the
    sequence under SP (the matmuls keep it). lctrain's norm recomputes the rest in its backward
    (`models.llama.RMSNorm`)."""
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
    op by op in docs/parallelism.md §11 and exact against `lctrain.training.measure`
    measurements, fp32 and bf16.

    n = batch * S / cp local tokens; t = tp; s = t with SP, else 1; D, F model and SwiGLU
    widths, D_q = H * d the queries' width (D unless model.head_dim says otherwise), D_kv =
    H_kv * d, H heads, k KV replication (Ulysses); a, r, casts: `dtype_bytes`;
    N = (r D + 4)/s + a D, one norm (`_norm_bytes`). Per token, in bytes:
      none:      2 N + a (2 D_q + 2 k D_kv + 4 F)/t + 4 H/t  [+ a D_q/t Ulysses/USP]
                 the two norms, then q, k, v, the attention output, its fp32 lse and the four
                 SwiGLU tensors on the TP shard; a qk_norm family's head norms
                 (a (D_q + D_kv) + 4 (H + H_kv))/t (`_head_norm_bytes`); at cp > 1 what
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
                 attention is recomputed instead).
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
    if mode == "selective":  # local attention: its output and lse are kept too
        attention = n * (a * Dq + 4 * H) / t if p.cp == 1 else 0.0
        mlp = _moe_kept(cfg, n, a, mode) if moe else n * a * (2 * F / t + D)
        return n * (a * ((Dq + 2 * dkv) / t + D) + r * D / s) + attention + mlp
    attention_weights = D * hd * (2 * H + 2 * m.n_kv_heads) // t
    mlp_weights = (mlp_params(m, layer) - expert_params(m, layer) + expert_params(m, layer) // p.ep
                   if moe else 3 * D * F // t)
    per_token = 2 * _norm_bytes(D, s, a, r) + a * (2 * Dq + 2 * k * dkv) / t + 4 * H / t
    if model_family(m.family).qk_norm:
        per_token += _head_norm_bytes(m, a) / t
    if p.cp > 1:  # what the algorithm keeps besides (`MemoryTerms.kept_per_token`)
        per_token += cp_algorithm(p.attention).memory.kept_per_token(
            layer_shape(cfg, world_size, batch))
    # (the position-aware kernels' positions are the micro-batch's host block, made once: none
    # per layer)
    if cfg.train.mlp_chunk:
        per_block = 8 * cfg.train.seq_len // p.cp + (a * attention_weights if casts else 0)
        return n * per_token + per_block
    per_block = a * (attention_weights + mlp_weights) if casts else 0
    mlp = _moe_kept(cfg, n, a, mode) if moe else n * a * 4 * F / t
    return n * per_token + mlp + per_block


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
      selective: the matmul outputs, a (2 F_e + D) per row and a E per token (the router)."""
    m, ep = cfg.model, cfg.parallel.ep > 1
    k, E, D, F = m.experts_per_token, m.n_experts, m.dim, m.expert_dim
    rows = n * k
    if mode == "selective":
        return rows * a * (2 * F + D) + n * a * E
    biased = model_family(m.family).expert_bias
    token = (a * (k * D * (2 if ep else 1) + k) + 4 * E + 24 * k
             + (4 * k + 4 if m.norm_topk_prob else 0))
    row = a * ((7 if biased else 4) * F + 2 * D) + (8 if biased else 0) + (8 if ep else 0)
    return n * token + rows * row


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
    return 2 * rows * cfg.model.d_head * dtype_bytes(cfg, world_size)[0]


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
    terms = cp_algorithm(p.attention).memory if p.cp > 1 else MemoryTerms()
    balance = load_balance_of(cfg) if p.cp > 1 else "none"
    sorts = terms.sorts_positions and balance == "zigzag"
    tokens = terms.block_tokens(batch * S, p.cp)
    total = 8 * tokens * (2 if sorts else 1) if cfg.data.document_masking else 0
    if sorts:
        total += 24 * S  # three int64 tensors of S: sort index, inverse, sorted positions
    if balance == "documents":
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


@cache  # pure in its arguments; a layout search asks for the same ones many times
def in_flight_moments(schedule: str, pp: int, microbatches: int, virtual: int,
                      pp_rank: int) -> tuple[tuple[int, ...], ...]:
    """Micro-batches whose activations each stage of pipeline rank `pp_rank` keeps (in
    `rank_stages` order) each time, from its warm-up's end on, the rank has just run a forward
    (and under the interleaved schedules each time it runs a backward of the drain, where the
    sends it holds grow while its activations shrink): its peak is one of them. Activations live from a micro-batch's forward to its backward, to
    its weight gradient W under the zero-bubble schedules (torch's input-gradient step keeps the
    graph for W: `stage_backward_input`), in the orders torch 2.13's schedules build."""
    p, m, v, r = pp, microbatches, virtual, pp_rank
    if p == 1:  # no pipeline: one micro-batch at a time through the whole model
        return ((1,) * len(rank_stages(0, 1, v, schedule)),)
    if schedule == "gpipe":  # every forward before the first backward (docs/parallelism.md §13)
        return ((m,),)
    if schedule == "1f1b":  # p - r warm-up forwards, then a backward after each forward (§13)
        return ((min(m, p - r),),)
    if schedule == "zbv":  # 2p: at the first forward of stage 2p-1-r, then at each of stage r
        return ((2 * p - r - 1, r + 1), (2 * p - r, r))
    # interleaved: w = (v-1) q + 2 (p-1-r) warm-up chunk forwards, q micro-batches per round,
    # then a forward and a backward per op: w + 1 at each moment; zero bubble: (p-1-r) and each
    # W r ops behind its backward: (v-1) q + p. The k-th forward runs chunk (k // q) mod v, the
    # k-th backward chunk v-1 - (k // q) mod v (docs/parallelism.md §13).
    q, warmup, on_chunk = _interleaved(schedule, p, m, v, r)
    lag = r if schedule == "zero_bubble" else 0
    return tuple(tuple(on_chunk(min(k + 1, m * v), j)
                       - on_chunk(min(max(0, k - warmup - lag), m * v), v - 1 - j)
                       for j in range(v)) for k in _moments(warmup, m * v))


def _interleaved(schedule: str, p: int, m: int, v: int, r: int):
    """(q, w, on_chunk) of an interleaved schedule at pipeline rank r: q micro-batches per
    round, w warm-up chunk forwards, and on_chunk(n, j), of the rank's first n chunk ops those
    on chunk j."""
    q = m // max(1, m // p)
    warmup = min((v - 1) * q + (2 if schedule == "interleaved_1f1b" else 1) * (p - 1 - r), m * v)

    def on_chunk(n: int, j: int) -> int:
        cycles, rest = divmod(n, q * v)
        return cycles * q + min(q, max(0, rest - j * q))

    return q, warmup, on_chunk


def _moments(warmup: int, chunks: int) -> range:
    """The op indices k of an interleaved schedule's moments: after its warm-up, each forward
    (k < chunks: the k-th chunk forward has run, then its backward follows), then each backward
    of the drain (k >= chunks: forwards are done, backward k - warmup is next)."""
    return range(min(warmup, chunks - 1), chunks + warmup)


@cache
def passes_at_moments(schedule: str, pp: int, microbatches: int, virtual: int,
                      pp_rank: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None:
    """For each moment of `in_flight_moments` (in its order), the forwards and the input-
    gradient passes (B) each stage of pipeline rank `pp_rank` has run by then, for the
    interleaved schedules (interleaved_1f1b, zero_bubble), whose sends all stay until the step
    ends; None for the others (their sends are waited for soon; ZBV's two moments come from its
    peak alone)."""
    if pp == 1 or schedule not in ("interleaved_1f1b", "zero_bubble"):
        return None
    p, m, v, r = pp, microbatches, virtual, pp_rank
    _, warmup, on_chunk = _interleaved(schedule, p, m, v, r)
    return tuple((tuple(on_chunk(min(k + 1, m * v), j) for j in range(v)),
                  tuple(on_chunk(min(max(0, k - warmup), m * v), v - 1 - j) for j in range(v)))
                 for k in _moments(warmup, m * v))


def backward_stages(schedule: str, pp: int, microbatches: int, virtual: int,
                    pp_rank: int) -> list[int | None]:
    """At each moment of `in_flight_moments`, the position (in `rank_stages` order) of the
    stage whose backward the rank runs next, for the interleaved schedules (the b-th backward
    runs chunk (b // q) mod v, its stage v - 1 less that); None where it is not known (the
    other schedules), which counts every stage's working set."""
    p, m, v, r = pp, microbatches, virtual, pp_rank
    if p == 1 or schedule not in ("interleaved_1f1b", "zero_bubble"):
        return [None] * len(in_flight_moments(schedule, pp, microbatches, virtual, pp_rank))
    q, warmup, _ = _interleaved(schedule, p, m, v, r)
    return [v - 1 - (max(0, k - warmup) // q) % v for k in _moments(warmup, m * v)]


def accumulating_share(cfg: LctrainConfig, world_size: int, pp_rank: int) -> list[float]:
    """At each moment of `in_flight_moments`, the share of the rank's parameters (by stage)
    whose stage has run a backward pass in the step by then, and so holds gradients accumulated
    between micro-steps (`accumulated_grad_bytes`): under the interleaved schedules a rank's
    later stages run their first backward before its earlier ones; 1 for the others."""
    p = cfg.parallel
    args = (p.pp_schedule, p.pp, derive(cfg, world_size).grad_accum, p.pp_virtual_stages,
            pp_rank)
    passes = passes_at_moments(*args)
    if passes is None:
        return [1.0] * len(in_flight_moments(*args))
    sizes = [stage_params(cfg, s) for s in stages_of(cfg, pp_rank)]
    return [sum(n for n, b in zip(sizes, bwd) if b) / sum(sizes) for _, bwd in passes]


def peak_in_flight(moments: tuple[tuple[int, ...], ...],
                   stage_bytes: list[float]) -> tuple[int, ...]:
    """The moment of `in_flight_moments` that keeps the most bytes, one micro-batch keeping
    `stage_bytes` on each stage (the first such moment)."""
    return max(moments, key=lambda counts: sum(c * b for c, b in zip(counts, stage_bytes)))


def stage_activation_bytes(cfg: LctrainConfig, world_size: int, batch: int, stage: int) -> float:
    """Bytes one micro-batch keeps for the backward on pipeline stage `stage`: its blocks, and the
    loss head (`head_activation_formula`) on the last stage, the RoPE tables alone on the others
    (every stage computes its own); less the stage input when it arrives in a receive buffer
    (`pipeline_buffer_bytes` counts those) and the first block keeps that very tensor on the
    device: its norm's input, or the input a checkpointed block keeps (docs/parallelism.md §13)."""
    stages, t = split_layers(cfg), cfg.train
    total = sum(n * activation_formula(cfg, world_size, batch, i)
                for i, n in layer_kinds(cfg.model, stages[stage]))
    if stage == len(stages) - 1:
        total += head_activation_formula(cfg, world_size, batch)
    elif cfg.parallel.pp > 1:
        total += rope_table_bytes(cfg, world_size, batch)
    if _receives(cfg, stage, -1) and not t.offload_activations:
        total -= _stage_io_bytes(cfg, world_size, batch)
    return total


def pipeline_buffer_bytes(cfg: LctrainConfig, world_size: int, batch: int, pp_rank: int) -> float:
    """The receive buffers torch's PipelineStage allocates on its first step and keeps, one per
    micro-batch of the step (`_setup_forward_recv_info`, `_create_grad_recv_info`): for each
    stage of the rank whose previous stage runs on another rank, the activations
    [B, S/(cp*tp) with SP else S/cp, D] in the residual dtype; for each whose next stage does,
    their gradients, alike (docs/parallelism.md §13)."""
    m = derive(cfg, world_size).grad_accum
    links = sum(_receives(cfg, s, -1) + _receives(cfg, s, 1) for s in stages_of(cfg, pp_rank))
    return links * m * _stage_io_bytes(cfg, world_size, batch)


def pipeline_send_bytes(cfg: LctrainConfig, world_size: int, batch: int, pp_rank: int
                        ) -> list[float]:
    """What the rank's sends and stage outputs hold beyond the blocks' kept bytes, at each
    moment of `in_flight_moments`. A stage keeps its output until that micro-batch's backward,
    and a send keeps its tensor until it is waited for, as NCCL does. torch's interleaved
    schedules (interleaved_1f1b, zero_bubble) wait for every send at the end of the step, so
    each output sent forward and each input gradient sent back stays until then: one for every
    forward and B pass the rank has run by that moment (`passes_at_moments`) on a stage whose
    neighbour runs on another rank. 1F1B and GPipe wait for each send soon, and ZBV's peak
    comes before its backward passes: the outputs in flight of each stage whose next stage runs
    elsewhere, and one input gradient being sent back per link (docs/parallelism.md §13)."""
    p = cfg.parallel
    stages = stages_of(cfg, pp_rank)
    forward = [_receives(cfg, s, 1) for s in stages]  # the next stage on another rank
    backward = [_receives(cfg, s, -1) for s in stages]  # the previous one
    m = derive(cfg, world_size).grad_accum
    args = (p.pp_schedule, p.pp, m, p.pp_virtual_stages, pp_rank)
    passes = passes_at_moments(*args)
    if passes is None:
        held = [sum(n for n, sends in zip(counts, forward) if sends) + sum(backward)
                for counts in in_flight_moments(*args)]
    else:
        held = [sum(f * sends for f, sends in zip(fwd, forward))
                + sum(b * sends for b, sends in zip(bwd, backward)) for fwd, bwd in passes]
    io = _stage_io_bytes(cfg, world_size, batch)
    return [n * io for n in held]


def _receives(cfg: LctrainConfig, stage: int, step: int) -> bool:
    """Whether `stage` receives from its neighbour `stage + step` (-1: activations, 1:
    gradients): the neighbour exists and runs on another pipeline rank."""
    neighbour = stage + step
    if not 0 <= neighbour < stage_count(cfg):
        return False
    return rank_of(cfg, neighbour) != rank_of(cfg, stage)


def _stage_io_bytes(cfg: LctrainConfig, world_size: int, batch: int) -> float:
    """Bytes of one micro-batch's hidden state between stages, [B, S/(cp*s), D] (s = tp with SP)
    in the residual dtype."""
    p = cfg.parallel
    s = p.tp if (p.sp and p.tp > 1) else 1
    r = dtype_bytes(cfg, world_size)[1]
    return batch * cfg.train.seq_len // p.cp // s * cfg.model.dim * r
