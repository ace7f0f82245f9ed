"""A model config's size, layer by layer, as pure numbers: the parameters of each block (TP's
sharded and replicated parts, the MLP's, a mixture of experts' router and experts, those one
token meets) and the training FLOPs per token of each layer (matmuls, causal or windowed
attention, the output layer and its softmax). The pipeline's stage cut, the memory and traffic
formulas and MFU all count with them.
"""

from __future__ import annotations

from functools import cache

from lctrain.config.model_families import model_family
from lctrain.config.model_parts import EXPERT_BIAS, ROUTER_BIAS
from lctrain.config.schema import ModelConfig

MLP_MATRICES = 3
"""SwiGLU's gate, up and down projections, D x F each."""


def expert_params(m: ModelConfig, layer: int, experts: int | None = None) -> int:
    """Parameters of `experts` experts (all of them by default) of block `layer`: each three
    D x F_e matrices and, in a family with expert biases, 2 F_e + D biases; 0 for a dense
    MLP."""
    if not m.is_moe_layer(layer):
        return 0
    bias = 2 * m.expert_dim + m.dim if model_family(m.family).has(EXPERT_BIAS) else 0
    count = m.n_experts if experts is None else experts
    return count * (MLP_MATRICES * m.dim * m.expert_dim + bias)


def mlp_params(m: ModelConfig, layer: int, active: bool = False) -> int:
    """Parameters of block `layer`'s MLP: the gated MLP's three D x F matrices; for a mixture of
    experts the router (E x D, and a bias), a shared expert's three D x F_s matrices and its
    gate's D, and its experts (`expert_params`), or with `active` the k experts one token runs
    through."""
    if not m.is_moe_layer(layer):
        return MLP_MATRICES * m.dim * m.ffn_dim
    router = m.n_experts * (m.dim + (1 if model_family(m.family).has(ROUTER_BIAS) else 0))
    if m.shared_expert_ffn_dim is not None:
        router += MLP_MATRICES * m.dim * m.shared_expert_ffn_dim + m.dim
    return router + expert_params(m, layer, m.experts_per_token if active else None)


def linear_mixer_params(m: ModelConfig) -> tuple[int, int]:
    """(parameters TP shards, parameters TP replicates) of a Gated DeltaNet layer's mixer: the
    projections to Q, K, V (2 H_k d_k + H_v d_v channels), to the gate Z (H_v d_v), to beta and
    the decay's input (H_v each) and back (H_v d_v x D); the convolution's kernel per channel;
    dt_bias and A_log per value head; the gated norm's d_v weights (replicated)."""
    channels = m.linear_conv_channels
    values = m.linear_value_heads * m.linear_value_dim
    sharded = (m.dim * (channels + 2 * values + 2 * m.linear_value_heads)
               + channels * m.linear_conv_kernel + 2 * m.linear_value_heads)
    return sharded, m.linear_value_dim


def block_split(m: ModelConfig, layer: int = 0) -> tuple[int, int]:
    """(parameters TP shards, parameters TP replicates) of transformer block `layer`: Q, K, V, O
    (or a linear-attention layer's mixer, `linear_mixer_params`) and the MLP's matrices
    (`mlp_params`), plus the family's biases (`ModelFamily.block_extra_params`, its parts'); the
    two norms, plus its parts' replicated ones."""
    linear = linear_mixer_params(m) if m.is_linear_layer(layer) else None
    return _block_split(m.family, m.dim, m.d_head, m.n_heads, m.n_kv_heads,
                        mlp_params(m, layer), linear)


@cache  # pure in its arguments; a layout search asks for the same ones many times
def _block_split(family: str, dim: int, d_head: int, heads: int, kv_heads: int,
                 mlp: int, linear: tuple[int, int] | None) -> tuple[int, int]:
    mixer = (dim * (2 * heads * d_head + 2 * kv_heads * d_head), 0) if linear is None else linear
    sharded, replicated = model_family(family).block_extra_params(
        dim, d_head, heads, kv_heads, attention=linear is None)
    return mixer[0] + mlp + sharded, 2 * dim + mixer[1] + replicated


def layer_kinds(m: ModelConfig, layers) -> list[tuple[int, int]]:
    """(a layer, how many) for each kind among `layers`: the layers whose blocks hold, compute
    and keep alike (dense or a mixture of experts, attention or linear, the same window), so that a
    formula is evaluated once per kind (a layout search evaluates many)."""
    kinds: dict[tuple[bool, bool, int | None], tuple[int, int]] = {}
    for i in layers:
        key = (m.is_moe_layer(i), m.is_linear_layer(i), m.layer_window(i))
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
    embedding, _, output = unit_costs(m, seq_len)
    return embedding, [TRAIN_OVER_FORWARD * FLOPS_PER_WEIGHT * block_params(m, i, active=True)
                       + mixer_flops(m, seq_len, i) for i in range(m.n_layers)], output


def mixer_flops(m: ModelConfig, seq_len: int, layer: int) -> float:
    """Training FLOPs per token of block `layer`'s token mixer beyond its weights: causal
    attention (`attention_flops`) or the gated delta rule (`linear_mixer_flops`)."""
    if m.is_linear_layer(layer):
        return linear_mixer_flops(m)
    return attention_flops(m, seq_len, m.layer_window(layer))


DELTA_CHUNK = 64
"""Tokens per chunk of the chunked gated delta rule (lctrain.attention.delta_rule)."""


def linear_mixer_flops(m: ModelConfig) -> float:
    """Training FLOPs per token of a Gated DeltaNet layer's recurrence (docs/parallelism.md
    §31), the same at every sequence length. Per value head and token, over chunks of C
    tokens: the chunk's K K^T and Q K^T (C d_k multiply-adds each), the WY factors A K and A V
    (C d_k and C d_v), the output's intra-chunk term (C d_v); the state's Q S, W S and its
    update K^T U (d_k d_v each); the causal convolution's k per channel. Forward x 2 FLOPs
    per multiply-add, x 3 for training; the triangular solve per chunk (C/3 per token) is
    left out."""
    c, dk, dv = DELTA_CHUNK, m.linear_key_dim, m.linear_value_dim
    per_head = c * (3 * dk + 2 * dv) + 3 * dk * dv
    channels = m.linear_conv_channels
    forward = FLOPS_PER_WEIGHT * (m.linear_value_heads * per_head
                                  + m.linear_conv_kernel * channels)
    return TRAIN_OVER_FORWARD * forward


def state_passing_extra_flops(m: ModelConfig) -> float:
    """Training FLOPs per token a Gated DeltaNet layer runs beyond `linear_mixer_flops` under
    context parallelism by state passing (docs/parallelism.md §31): the first pass over the
    rank's stretches from a zero state, which computes the recurrence again (the convolution
    not) and the stretch's transition, per chunk (carry I - K_s^T W) T: C d_k^2 + d_k^3
    multiply-adds per value head, d_k^2 + d_k^3 / C per token. Not model FLOPs (MFU leaves them
    out); the step's time counts them."""
    c, dk, dv = DELTA_CHUNK, m.linear_key_dim, m.linear_value_dim
    per_head = c * (3 * dk + 2 * dv) + 3 * dk * dv + dk * dk + dk ** 3 / c
    return TRAIN_OVER_FORWARD * FLOPS_PER_WEIGHT * m.linear_value_heads * per_head


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


def unit_costs(m: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """`layer_costs` with one block's cost (every block costs the same); the embedding a row
    lookup, d_model per token."""
    return _unit_costs_of(block_params(m), attention_flops(m, seq_len), m.dim, m.vocab_size)


@cache  # a layout search asks for the same ones many times
def _unit_costs_of(block_weights: int, attention: float, dim: int,
                   vocab: int) -> tuple[float, float, float]:
    block = TRAIN_OVER_FORWARD * FLOPS_PER_WEIGHT * block_weights + attention
    output = TRAIN_OVER_FORWARD * (FLOPS_PER_WEIGHT * dim + SOFTMAX_FLOPS) * vocab
    return TRAIN_OVER_FORWARD * dim, block, output


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
