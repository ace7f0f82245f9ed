"""Pipeline stages as pure numbers: which layers each stage holds, which pipeline rank runs each
stage, and the idle fraction (bubble) of each schedule (docs/parallelism.md §13).

The model is cut into pp x v contiguous stages (v = parallel.pp_virtual_stages). The embedding
goes with the first stage and the final norm, output layer and loss with the last. Without an
explicit parallel.pp_layers the cut minimises the most expensive stage, with costs in training
FLOPs per token: a block costs its matmuls plus causal attention over the whole sequence, the
output layer its [D, V] matmul, the embedding a row lookup (docs/parallelism.md §13).
"""

from __future__ import annotations

from functools import cache

from lctrain.config import LctrainConfig, ModelConfig
from lctrain.config.model_families import model_family

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""Schedules that run one stage per pipeline rank."""


MLP_MATRICES = 3
"""SwiGLU's gate, up and down projections, D x F each."""


def expert_params(m: ModelConfig, layer: int, experts: int | None = None) -> int:
    """Parameters of `experts` experts (all of them by default) of block `layer`: each three
    D x F_e matrices and, in a family with expert biases, 2 F_e + D biases; 0 for a dense
    MLP."""
    if not m.is_moe_layer(layer):
        return 0
    bias = 2 * m.expert_dim + m.dim if model_family(m.family).expert_bias else 0
    count = m.n_experts if experts is None else experts
    return count * (MLP_MATRICES * m.dim * m.expert_dim + bias)


def mlp_params(m: ModelConfig, layer: int, active: bool = False) -> int:
    """Parameters of block `layer`'s MLP: the gated MLP's three D x F matrices; for a mixture of
    experts the router (E x D, and a bias) and its experts (`expert_params`), or with `active`
    the k experts one token runs through."""
    if not m.is_moe_layer(layer):
        return MLP_MATRICES * m.dim * m.ffn_dim
    router = m.n_experts * (m.dim + (1 if model_family(m.family).router_bias else 0))
    return router + expert_params(m, layer, m.experts_per_token if active else None)


def block_split(m: ModelConfig, layer: int = 0) -> tuple[int, int]:
    """(parameters TP shards, parameters TP replicates) of transformer block `layer`: Q, K, V, O
    and the MLP's matrices (`mlp_params`), plus the family's biases
    (`ModelFamily.block_extra_params`); the two norms, plus the family's head norms."""
    return _block_split(m.family, m.dim, m.d_head, m.n_heads, m.n_kv_heads,
                        mlp_params(m, layer))


@cache  # pure in its arguments; a layout search asks for the same ones many times
def _block_split(family: str, dim: int, d_head: int, heads: int, kv_heads: int,
                 mlp: int) -> tuple[int, int]:
    attention = dim * (2 * heads * d_head + 2 * kv_heads * d_head)
    sharded, replicated = model_family(family).block_extra_params(dim, d_head, heads, kv_heads)
    return attention + mlp + sharded, 2 * dim + replicated


def layer_kinds(m: ModelConfig, layers) -> list[tuple[int, int]]:
    """(a layer, how many) for each kind among `layers`: the layers whose blocks hold, compute
    and keep alike (dense or a mixture of experts, and the same attention window), so that a
    formula is evaluated once per kind (a layout search evaluates many)."""
    kinds: dict[tuple[bool, int | None], tuple[int, int]] = {}
    for i in layers:
        key = (m.is_moe_layer(i), m.layer_window(i))
        first, count = kinds.get(key, (i, 0))
        kinds[key] = (first, count + 1)
    return list(kinds.values())


def block_params(m: ModelConfig, layer: int = 0, active: bool = False) -> int:
    """Parameters of transformer block `layer`, whole (`block_split`'s two parts); with
    `active`, those one token's forward multiplies by (a mixture of experts' k experts)."""
    whole = sum(block_split(m, layer))
    return whole if not active else whole - mlp_params(m, layer) + mlp_params(m, layer, True)


def layer_costs(m: ModelConfig, seq_len: int) -> tuple[float, list[float], float]:
    """(embedding, [each block], output layer + loss): forward + backward FLOPs per token, 3x the
    forward's. A block's forward is 2 FLOPs per weight a token meets (a mixture of experts'
    router and k experts) plus causal attention, 2 S d_model
    (QK^T and PV over S/2 keys on average; a window layer's over its window's keys); the
    output layer 2 D V plus the softmax (~5 V)."""
    embedding, _, output = _unit_costs(m, seq_len)
    return embedding, [TRAIN_OVER_FORWARD * FLOPS_PER_WEIGHT * block_params(m, i, active=True)
                       + attention_flops(m, seq_len, m.layer_window(i))
                       for i in range(m.n_layers)], output


TRAIN_OVER_FORWARD = 3
"""Training FLOPs per forward FLOP: the backward runs two matmuls for each forward one (the
gradient of the input and that of the weight)."""
FLOPS_PER_WEIGHT = 2
"""A matmul's FLOPs per weight and token: a multiply and an add."""
SOFTMAX_FLOPS = 5
"""The loss's softmax per vocabulary entry and token: max, subtract, exp, sum, divide."""


def attention_flops(m: ModelConfig, seq_len: int, window: int | None = None) -> float:
    """Training FLOPs per token of one block's causal attention: QK^T and PV take H x d
    multiply-adds per key each (d_model unless model.head_dim says otherwise), over S/2 keys
    on average, so 2 x 2 x Hd x S/2 = 2 S Hd forward. A window of W < S keys: each query sees
    W keys but the first W - 1, so W - W (W - 1) / (2 S) on average (docs/parallelism.md §25)."""
    keys = seq_len / 2 if window is None or window >= seq_len else (
        window - window * (window - 1) / (2 * seq_len))
    return TRAIN_OVER_FORWARD * 4 * keys * m.q_dim


def _unit_costs(m: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """`layer_costs` with one block's cost (every block costs the same); the embedding a row
    lookup, d_model per token."""
    return _unit_costs_of(block_params(m), attention_flops(m, seq_len), m.dim, m.vocab_size)


@cache  # a layout search asks for the same ones many times
def _unit_costs_of(block_weights: int, attention: float, dim: int,
                   vocab: int) -> tuple[float, float, float]:
    block = TRAIN_OVER_FORWARD * FLOPS_PER_WEIGHT * block_weights + attention
    output = TRAIN_OVER_FORWARD * (FLOPS_PER_WEIGHT * dim + SOFTMAX_FLOPS) * vocab
    return TRAIN_OVER_FORWARD * dim, block, output


def stage_count(cfg: LctrainConfig) -> int:
    return cfg.parallel.pp * cfg.parallel.pp_virtual_stages


def split_layers(cfg: LctrainConfig) -> tuple[tuple[int, ...], ...]:
    """Global layer ids of every stage, in pipeline order (parallel.pp_layers, or balanced)."""
    explicit = cfg.parallel.pp_layers
    if explicit:
        return _layer_ids(tuple(explicit))
    m = cfg.model  # (balanced_counts, without the copy to a list: a search asks very often)
    return _layer_ids(_best_split(m.n_layers, stage_count(cfg),
                                  *_unit_costs(m, cfg.train.seq_len)))


@cache  # a layout search asks for the same split many times
def _layer_ids(counts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return tuple(tuple(range(start, start + c)) for start, c in zip(starts, counts))


def balanced_counts(m: ModelConfig, seq_len: int, stages: int) -> list[int]:
    """Layers per stage (each at least one) minimising the largest stage cost, the embedding
    counted in the first stage and the output layer in the last; ties go to earlier stages
    holding fewer layers (the first stage also keeps its micro-batches in flight longest)."""
    return list(_best_split(m.n_layers, stages, *_unit_costs(m, seq_len)))


@cache
def _best_split(layers: int, stages: int, first_extra: float, block: float,
                last_extra: float) -> tuple[int, ...]:
    # max stage cost of cutting `left` layers into `k` stages where the first is stage `index`
    @cache
    def best(left: int, k: int, index: int) -> tuple[float, tuple[int, ...]]:
        if k == 1:
            cost = left * block + (first_extra if index == 0 else 0) + last_extra
            return cost, (left,)
        options = []
        for take in range(1, left - k + 2):
            cost = take * block + (first_extra if index == 0 else 0)
            rest_cost, rest = best(left - take, k - 1, index + 1)
            options.append((max(cost, rest_cost), (take, *rest)))
        cost, split = min(options)
        return cost, split

    return best(layers, stages, 0)[1]


def rank_stages(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stages pipeline rank `pp_rank` runs, in order: looped (r, r + pp, ...) or, for zbv,
    a V (r and 2 pp - 1 - r: the first and the last stage on rank 0)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def stage_rank(stage: int, pp: int, virtual: int, schedule: str) -> int:
    """The pipeline rank that runs `stage` (the inverse of `rank_stages`)."""
    if schedule == "zbv":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def stages_of(cfg: LctrainConfig, pp_rank: int) -> list[int]:
    """`rank_stages` of pipeline rank `pp_rank` under cfg's schedule."""
    p = cfg.parallel
    return rank_stages(pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule)


def rank_of(cfg: LctrainConfig, stage: int) -> int:
    """`stage_rank` of `stage` under cfg's schedule."""
    p = cfg.parallel
    return stage_rank(stage, p.pp, p.pp_virtual_stages, p.pp_schedule)


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle time / step time of a pipeline rank, stages of equal cost, a backward twice a
    forward, split evenly into input and weight gradients (docs/parallelism.md §13)."""
    p, m, v = pp, microbatches, virtual
    if p == 1:
        return 0.0
    if schedule in SINGLE_STAGE_SCHEDULES:
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule in ("zero_bubble", "zbv"):  # weight gradients fill two thirds of the bubble
        return (p - 1) / (3 * v * m + p - 1)
    raise ValueError(f"unknown schedule {schedule}")
