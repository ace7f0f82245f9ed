"""Elements each rank sends: one attention layer per context-parallel algorithm (forward and
backward), one block's TP/SP collectives, one step of FSDP. Derived in docs/parallelism.md
§2 and §5-9; `lctrain plan` predicts with these, and tests and bench/attention.py compare them
with what `lctrain.comm.record_traffic` measures. `step_traffic_bytes` adds them up into
the bytes one rank sends per step in the groups whose collectives lctrain does not issue itself
(TP, pipeline, data parallelism), which the training loop logs (docs/parallelism.md §14);
`cp_step_bytes` the context-parallel attention's per step, collective by collective, as
`record_traffic` counts them (§16).

L: global sequence (one sample), d = H * head_dim and d_kv = H_kv * r * head_dim per TP rank
(r = KV replication), P = cp, u = Ulysses degree, R = ring degree = P / u. The attention's
formulas are its registry entry's (`lctrain.config.cp_algorithms`); this module adds them up.
"""

from __future__ import annotations

import dataclasses

from lctrain.config import LctrainConfig, derive
from lctrain.config.cp_algorithms import cp_algorithm
from lctrain.config.derived import (
    compute_bytes,
    data_parallel_engine_of,
    dtype_bytes,
    load_balance_of,
    reduces_each_micro_step,
)
from lctrain.config.load_balances import split_of
from lctrain.config.model_size import expert_params
from lctrain.layout.halo import unit_halo
from lctrain.layout.stages import rank_of, split_layers, stage_count, stages_of
from lctrain.planning.cp_costs import Transfer, cp_costs, halo_transfers
from lctrain.planning.documents import travelling_share
from lctrain.planning.schedule import pipeline_buffer_bytes, stage_activation_bytes
from lctrain.planning.state import local_params

DIRECTIONS = {"fwd": "forward", "bwd": "backward"}
"""`Transfer.direction` -> the key of `attention_traffic`."""


def attention_traffic(algorithm: str, seq_len: int, d: int, d_kv: int, cp: int, ulysses: int,
                      batch: int = 1, share: float = 1.0,
                      halo: tuple[float, float] | None = None) -> dict[str, float]:
    """{'forward': elements, 'backward': elements} sent per rank: the sum of the algorithm's
    transfers (`CPAlgorithm.transfers`); `ulysses` is parallel.ulysses_degree (an algorithm
    whose degree is fixed ignores it); `share` is the travelling share of its key blocks
    (packed documents: the tokens other ranks attend, padded to the largest block; §24);
    `halo`, for a window layer, the tokens its balance unit sends and receives (§25)."""
    out = {"forward": 0.0, "backward": 0.0}
    if cp == 1:
        return out
    for x in layer_transfers(algorithm, seq_len, d, d_kv, cp, ulysses, share, halo):
        out[DIRECTIONS[x.direction]] += batch * x.elements
    return out


def layer_transfers(algorithm: str, seq_len: int, d: float, d_kv: float, cp: int,
                    ulysses: int, share: float = 1.0,
                    halo: tuple[float, float] | None = None) -> tuple[Transfer, ...]:
    """The algorithm's transfers in one layer, the travelling ones scaled by `share` (§24), or,
    in a window layer whose balance unit sends and receives `halo` tokens, the halo exchange
    (§25)."""
    u = cp_algorithm(algorithm).degree(cp, ulysses)
    transfers = cp_costs(algorithm).transfers(seq_len, d, d_kv, cp, u)
    if halo is not None:
        return halo_transfers(transfers, halo, d_kv, u)
    return tuple(dataclasses.replace(x, elements=x.elements * share)
                 if x.travelling and share != 1.0 else x for x in transfers)


def tp_block_traffic(tokens: int, dim: int, tp: int) -> float:
    """One block's forward TP collectives on [tokens, dim] activations: with SP two all-gathers
    and two reduce-scatters, without it two all-reduces; either way 4 (t-1)/t tokens dim
    elements (the backward sends the same)."""
    return 4 * (tp - 1) / tp * tokens * dim


def tp_recompute_traffic(tokens: int, dim: int, tp: int, sp: bool) -> float:
    """What one block's backward sends again when it recomputes the block's forward (selective
    or full checkpointing): with SP the two all-gathers and the reduce-scatter after wo, without
    it the all-reduce after wo (docs/parallelism.md §2, Note)."""
    return (3 if sp else 2) * (tp - 1) / tp * tokens * dim


def tp_end_traffic(tokens: int, dim: int, tp: int) -> float:
    """The vocabulary-parallel embedding's, or the output layer's, TP collectives in one forward
    and backward: a reduce-scatter (SP) or all-reduce of the embedding's output and, backward, an
    all-gather of its gradient (SP); an all-gather of the output layer's input (SP) and,
    backward, a reduce-scatter (SP) or all-reduce of its gradient: 2 (t-1)/t tokens dim
    elements each (docs/parallelism.md §14)."""
    return 2 * (tp - 1) / tp * tokens * dim


def dp_step_traffic(engine: str, blocks: int, root: int, shards: int, accum: int,
                    reduce_each: bool = False) -> float:
    """One optimizer step of data parallelism over `shards` ranks, for `blocks` and `root`
    parameters per rank and `accum` micro-steps (docs/parallelism.md §9).

    FSDP2: in every micro-step each block's parameters are all-gathered for the forward and again
    for the backward (they are freed in between), the root's once (never freed); gradients are
    reduce-scattered once, on the last micro-step, or in every one with `reduce_each` (FSDP's
    CPU offload, parallel.offload_state=optimizer+params). DDP: one all-reduce of the
    gradients."""
    return sum(_dp_parts(engine, blocks, root, shards, accum, reduce_each))


def _dp_parts(engine: str, blocks: int, root: int, shards: int, accum: int,
              reduce_each: bool = False) -> tuple[float, float]:
    """(elements of weights gathered, elements of gradients reduced) per rank and step."""
    if shards == 1:
        return 0.0, 0.0
    share = (shards - 1) / shards
    if engine == "ddp":
        return 0.0, 2 * share * (blocks + root)
    reductions = accum if reduce_each else 1
    return share * accum * (2 * blocks + root), share * reductions * (blocks + root)


def dp_step_bytes(engine: str, blocks: int, root: int, shards: int, accum: int,
                  compute_bytes: int, reduce_each: bool = False) -> float:
    """`dp_step_traffic` in bytes: FSDP gathers weights in the compute dtype (bf16 under
    train.dtype=bf16: its mixed-precision policy) and reduces gradients in fp32; DDP all-reduces
    fp32 gradients."""
    gathered, reduced = _dp_parts(engine, blocks, root, shards, accum, reduce_each)
    return gathered * compute_bytes + reduced * 4


def data_parallel_traffic(cfg: LctrainConfig, world_size: int, pp_rank: int, gathers: int,
                          engine: str | None = None) -> tuple[float, float]:
    """(elements, bytes) one rank of pipeline rank `pp_rank` sends per step over the n = dp x cp
    ranks (`dp_step_traffic`, `dp_step_bytes`), FSDP gathering weights in `gathers` micro-steps
    (`engine`: parallel.dp_engine unless given); under expert or tensor parallelism its experts
    apart (not split by TP): 1/ep of them, over the n tp / ep ranks that hold the same ones
    (docs/parallelism.md §28)."""
    m, p = cfg.model, cfg.parallel
    shards = derive(cfg, world_size).dp * p.cp
    blocks, root = local_params(cfg, pp_rank)
    layers = [i for s in stages_of(cfg, pp_rank) for i in split_layers(cfg)[s]]
    engine, each = engine or p.dp_engine, reduces_each_micro_step(cfg)
    parts = [(blocks, root, shards)]
    if m.n_experts and (p.ep > 1 or p.tp > 1):  # the experts over dp x cp x tp (not TP-split)
        experts = sum(expert_params(m, i) for i in layers)
        parts = [(blocks - experts // p.tp, root, shards),
                 (experts // p.ep, 0, shards * p.tp // p.ep)]
    return (sum(dp_step_traffic(engine, b, r, n, gathers, each) for b, r, n in parts),
            sum(dp_step_bytes(engine, b, r, n, gathers, compute_bytes(cfg), each)
                for b, r, n in parts))


def data_parallel_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int, gathers: int,
                        engine: str | None = None) -> float:
    """The bytes of `data_parallel_traffic`."""
    return data_parallel_traffic(cfg, world_size, pp_rank, gathers, engine)[1]


def host_copy_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> dict[str, float]:
    """Bytes one rank of pipeline rank `pp_rank` copies per step between host and device
    (docs/parallelism.md §22), {"to_device", "to_host"}: under parallel.offload_state=
    optimizer+params every FSDP gather first copies the fp32 shard to the device (each block
    twice per micro-step, the root once) and every micro-step's reduced gradient shard goes to
    the host; under optimizer, once per step, the gradients out and the updated weights back
    (4 bytes per parameter the rank holds); under train.offload_activations, what the blocks
    keep, out in the forward and back in the backward, every micro-step."""
    p, t = cfg.parallel, cfg.train
    out = {"to_device": 0.0, "to_host": 0.0}
    if p.offload_state == "none" and not t.offload_activations:
        return out
    d = derive(cfg, world_size)
    blocks, root = local_params(cfg, pp_rank)
    n = d.dp * p.cp if data_parallel_engine_of(cfg, world_size) == "fsdp" else 1
    if p.offload_state == "optimizer+params":
        out = {"to_device": 4 * d.grad_accum * (2 * blocks + root) / n,
               "to_host": 4 * d.grad_accum * (blocks + root) / n}
    elif p.offload_state == "optimizer":
        out = {"to_device": 4 * (blocks + root) / n, "to_host": 4 * (blocks + root) / n}
    if t.offload_activations:
        kept = d.grad_accum * sum(stage_activation_bytes(cfg, world_size, t.micro_batch, s)
                                  for s in stages_of(cfg, pp_rank))
        out = {k: v + kept for k, v in out.items()}
    return out


def tied_exchange_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int) -> float:
    """Bytes pipeline rank `pp_rank` sends per step for a tied embedding split over the first
    and last stage (docs/parallelism.md §27): the copy's fp32 gradient shard from the last
    stage's rank, the updated weight shard back from the first's, 4 V D / (tp n) each (n = dp x
    cp under FSDP, 1 otherwise); 0 where both ends share the rank (zbv) or nothing is tied."""
    m, p = cfg.model, cfg.parallel
    first, last = rank_of(cfg, 0), rank_of(cfg, stage_count(cfg) - 1)
    if not m.tie_embeddings or first == last or pp_rank not in (first, last):
        return 0.0
    d = derive(cfg, world_size)
    n = d.dp * p.cp if data_parallel_engine_of(cfg, world_size) == "fsdp" else 1
    return 4 * m.vocab_size * m.dim / (p.tp * n)


def expert_all_to_all_elements(sent_rows: int, received_rows: int, dim: int,
                               forwards: int = 1) -> int:
    """Elements one rank sends for one MoE layer under expert parallelism (docs/parallelism.md
    §28): the dispatch sends its `sent_rows` (token-expert pairs routed to other ranks'
    experts) and the combine sends back the `received_rows` it computed for other ranks, D
    elements each; the backward sends the gradients of both the way back, so 2 (s + q) D.
    `forwards` = 2 when activation checkpointing runs the layer's forward again."""
    return (forwards + 1) * (sent_rows + received_rows) * dim


def ep_step_bytes(cfg: LctrainConfig, world_size: int) -> float:
    """Bytes one rank sends per step in the experts' all-to-alls, at uniform routing: each of
    the n = micro_batch x S/(cp tp) tokens of a micro-step sends (ep - 1)/ep of its k rows to
    other ranks and receives as many (`expert_all_to_all_elements`), in each MoE layer."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    d = derive(cfg, world_size)
    # each rank routes its tokens: S/cp, and its sequence shard S/(cp tp) under TP (with SP)
    rows = t.micro_batch * t.seq_len // (p.cp * p.tp) * m.experts_per_token * (p.ep - 1) / p.ep
    forwards = 2 if t.activation_checkpointing == "full" else 1
    layers = len(m.moe_layer_ids)
    per_layer = expert_all_to_all_elements(rows, rows, m.dim, forwards)
    return d.grad_accum * layers * per_layer * dtype_bytes(cfg, world_size)[0]


def step_traffic_bytes(cfg: LctrainConfig, world_size: int) -> dict[str, float]:
    """Bytes one rank sends in one optimizer step, by group, from the formulas above: "tp"
    (DTensor's collectives), "pp" (the pipeline's sends and a tied embedding's exchange), "dp"
    (FSDP/DDP over dp x cp); only groups of more than one rank, each the largest over the
    pipeline ranks. "dp" is left out
    under pipelining (FSDP then keeps weights gathered across micro-batches, which
    `dp_step_traffic` does not model) and with DeepSpeed (its traffic is not modelled)
    (docs/parallelism.md §14)."""
    p, d = cfg.parallel, derive(cfg, world_size)
    out = {}
    if p.tp > 1:
        out["tp"] = max(_tp_step_bytes(cfg, world_size, r) for r in range(p.pp))
    if p.pp > 1:
        out["pp"] = max(pipeline_buffer_bytes(cfg, world_size, cfg.train.micro_batch, r)
                        + tied_exchange_bytes(cfg, world_size, r) for r in range(p.pp))
    if d.dp * p.cp > 1 and p.pp == 1 and p.dp_engine != "deepspeed":
        out["dp"] = data_parallel_bytes(cfg, world_size, 0, d.grad_accum)
    return out


def _tp_step_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int) -> float:
    """TP bytes pipeline rank `pp_rank` sends per step: its blocks forward and backward (and the
    recomputed forward under checkpointing; a mixture-of-experts block only its attention's),
    the output layer's collectives in the compute dtype, the embedding's in float32 (its lookup
    runs outside autocast)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    d = derive(cfg, world_size)
    tokens = t.micro_batch * d.local_seq_len
    stages, mine = split_layers(cfg), stages_of(cfg, pp_rank)
    layers = [i for s in mine for i in stages[s]]
    moe = sum(m.is_moe_layer(i) for i in layers)
    per_block = 2 * tp_block_traffic(tokens, m.dim, p.tp)
    # a mixture of experts routes each rank's sequence shard: only the attention's collectives
    per_moe_block = tp_block_traffic(tokens, m.dim, p.tp)
    if t.activation_checkpointing != "none":
        again = tp_recompute_traffic(tokens, m.dim, p.tp, p.sp)
        per_block += again
        per_moe_block += again - (p.tp - 1) / p.tp * tokens * m.dim  # no MLP all-gather
    end = tp_end_traffic(tokens, m.dim, p.tp)
    compute = (len(layers) - moe) * per_block + moe * per_moe_block
    compute += end if len(stages) - 1 in mine else 0
    fp32 = end if 0 in mine else 0
    return d.grad_accum * (compute_bytes(cfg) * compute + 4 * fp32)


def cp_transfers(cfg: LctrainConfig, world_size: int,
                 window: int | None = None) -> tuple[Transfer, ...]:
    """The collectives of one attention layer and sequence of this layout's algorithm at its
    widths per TP rank (KV replication included), the K/V blocks at the corpus's travelling
    share (plan.documents, §24); for a window layer (`window` < S) rank 0's halo exchange
    (§25; with load_balance=documents, one document's: packed documents send less); () when
    cp = 1."""
    d, m, p, t = derive(cfg, world_size), cfg.model, cfg.parallel, cfg.train
    if p.cp == 1:
        return ()
    dq, dkv = m.q_dim // p.tp, m.kv_dim // p.tp * d.kv_replication
    if window is not None and window < t.seq_len:
        halo = unit_halo(t.seq_len, p.cp, window, load_balance_of(cfg), d.cp_ulysses)
        return layer_transfers(p.attention, t.seq_len, dq, dkv, p.cp, p.ulysses_degree,
                               halo=halo)
    return layer_transfers(p.attention, t.seq_len, dq, dkv, p.cp, p.ulysses_degree,
                           travelling_share(cfg))


def layer_windows(cfg: LctrainConfig, layers) -> dict[int | None, int]:
    """{window (None: full attention): how many of `layers` (global ids) have it}; the
    linear-attention layers are not attention layers (`linear_layers`)."""
    out: dict[int | None, int] = {}
    for i in layers:
        if cfg.model.is_linear_layer(i):
            continue
        w = cfg.model.layer_window(i)
        key = w if w is not None and w < cfg.train.seq_len else None
        out[key] = out.get(key, 0) + 1
    return out


def linear_layers(cfg: LctrainConfig, layers) -> int:
    """How many of `layers` (global ids) are linear-attention layers."""
    return sum(cfg.model.is_linear_layer(i) for i in layers)


STRETCHES_PER_ROW = 2
"""Stretches (runs of consecutive positions) a rank holds in a row under a split per row
(load_balance=documents), for the state exchange's count: an estimate, as zigzag's two."""


def linear_transfers(cfg: LctrainConfig, how: str | None = None) -> tuple[Transfer, ...]:
    """The collectives of one linear-attention layer and sequence under context parallelism,
    by parallel.linear_cp (or `how`): `state_passing_transfers` or `head_split_transfers`; ()
    when cp = 1."""
    if cfg.parallel.cp == 1:
        return ()
    how = how or cfg.parallel.linear_cp
    return state_passing_transfers(cfg) if how == "state" else head_split_transfers(cfg)


def state_passing_transfers(cfg: LctrainConfig) -> tuple[Transfer, ...]:
    """The collectives of one Gated DeltaNet layer and sequence under context parallelism
    (docs/parallelism.md §31), whatever the sequence length: each rank all-gathers, per
    stretch it holds, the final state and transition of every value head, H_v d_k (d_v + d_k)
    float32 numbers, and the convolution's last k - 1 inputs, (k - 1) C_c in the compute dtype;
    the backward reduce-scatters their gradients. An all-gather over P ranks sends each piece
    P - 1 times."""
    m, p = cfg.model, cfg.parallel
    split = split_of(load_balance_of(cfg))
    slots = STRETCHES_PER_ROW if split.per_row else split.chunks_per_rank
    state = slots * m.linear_value_heads * m.linear_key_dim * (
        m.linear_value_dim + m.linear_key_dim) * (p.cp - 1) / p.tp
    channels = m.linear_conv_channels
    halo = slots * (m.linear_conv_kernel - 1) * channels * (p.cp - 1) / p.tp
    return (Transfer("state_all_gather", "fwd", "cp", state, 1, float32=True),
            Transfer("state_reduce_scatter", "bwd", "cp", state, 1, float32=True),
            Transfer("halo_all_gather", "fwd", "cp", halo, 1),
            Transfer("halo_reduce_scatter", "bwd", "cp", halo, 1))


def head_split_transfers(cfg: LctrainConfig) -> tuple[Transfer, ...]:
    """The head split's collectives (attention/delta_heads.py), which grow with the sequence:
    each rank sends (P - 1)/P of its S/P tokens' projected Q, K, V channels C_c (the compute
    dtype) and their 2 H_v decays and write strengths (float32) to the ranks of the other
    heads, and gets back its tokens' outputs, H_v d_v; the backward sends the same back."""
    m, p, s = cfg.model, cfg.parallel, cfg.train.seq_len
    share = s / p.cp * (p.cp - 1) / p.cp / p.tp
    channels = m.linear_conv_channels
    out = m.linear_value_heads * m.linear_value_dim
    return tuple(Transfer(name, direction, "cp", share * width, 1, float32=wide)
                 for direction in ("fwd", "bwd")
                 for name, width, wide in (("heads_all_to_all", channels, False),
                                           ("heads_rates_all_to_all", 2 * m.linear_value_heads,
                                            True),
                                           ("heads_out_all_to_all", out, False)))


RECOMPUTED = "_recompute"
"""The suffix of `cp_step_bytes`' keys for a forward collective sent again in the backward."""


def cp_step_groups(cfg: LctrainConfig, world_size: int) -> dict[str, str]:
    """The topology group that carries each key of `cp_step_bytes`."""
    out = {}
    linear = linear_transfers(cfg) if linear_layers(cfg, range(cfg.model.n_layers)) else ()
    transfers = [x for window in layer_windows(cfg, range(cfg.model.n_layers))
                 for x in cp_transfers(cfg, world_size, window)] + list(linear)
    for x in transfers:
        out[x.key] = x.group
        if x.direction == "fwd":
            out[x.collective + RECOMPUTED] = x.group
    return out


def cp_step_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> dict[str, float]:
    """Bytes one rank of pipeline rank `pp_rank` sends in the cp group per optimizer step, by
    collective and direction (docs/parallelism.md §5-8, §16): what `record_traffic` counts and
    the loop logs as `cp_bytes_sent`. Per layer and micro-batch the algorithm's transfers
    (`cp_transfers`), each in the compute dtype or, for those marked float32 (the ring's dK/dV
    accumulators, the reduce-scatter of all-gather's dK/dV), in float32, keyed
    `{collective}_{fwd|bwd}`; "..._recompute" the forward's collectives again in the backward
    when checkpointing recomputes the attention (selective at cp > 1, full). Times the rank's
    layers and the step's micro-batches. {} when cp = 1."""
    d, t = derive(cfg, world_size), cfg.train
    if cfg.parallel.cp == 1:
        return {}
    a = compute_bytes(cfg)
    layers = [i for s in stages_of(cfg, pp_rank) for i in split_layers(cfg)[s]]
    out: dict[str, float] = {}
    kinds = [(cp_transfers(cfg, world_size, window), count)
             for window, count in layer_windows(cfg, layers).items()]
    if linear_layers(cfg, layers):
        kinds.append((linear_transfers(cfg), linear_layers(cfg, layers)))
    for transfers, count in kinds:
        for x in transfers:
            nbytes = (4 if x.float32 else a) * t.micro_batch * x.elements * count * d.grad_accum
            keys = [x.key]
            if t.activation_checkpointing != "none" and x.direction == "fwd":
                keys.append(x.collective + RECOMPUTED)
            for key in keys:
                out[key] = out.get(key, 0.0) + nbytes
    return out
