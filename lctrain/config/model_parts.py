"""The parts a family's blocks may have beyond a Llama block (its features: Q/K/V biases, head
norms, sandwich norms, sinks, windows, ...), as every layer but the model code sees them: one
registry entry per part, holding what it adds to a block's parameter count and the line
`lctrain keys` prints for it. A family lists its parts (`ModelFamily.parts`); validation, the
parameter and FLOP counts, the memory formulas and the planner ask the family whether it has a
part (`ModelFamily.has`), never compare family names.

A part's code (the modules it adds to a block and where it acts in the forward) is registered
under the same name in `lctrain.models.parts`; docs/extending.md is the checklist for adding
one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from lctrain.config.registry import Registry


class BlockShape(NamedTuple):
    """The sizes a part's parameters follow."""

    dim: int
    head_dim: int
    n_heads: int
    n_kv_heads: int


def _none(_shape: BlockShape) -> int:
    return 0


@dataclass(frozen=True)
class ModelPart:
    name: str
    """The name a family lists in `ModelFamily.parts`."""
    summary: str
    """What it adds to a Llama block, for `lctrain keys`."""
    sharded: Callable[[BlockShape], int] = _none
    """Parameters per block that tensor parallelism shards (with the heads or columns)."""
    replicated: Callable[[BlockShape], int] = _none
    """Parameters per block that tensor parallelism replicates."""
    in_attention: bool = False
    """Its parameters are the attention's: a linear-attention layer has none of them."""


MODEL_PARTS: Registry[ModelPart] = Registry("model part")

QKV_BIAS = MODEL_PARTS.add(ModelPart(
    "qkv_bias", "Q/K/V biases", in_attention=True,
    sharded=lambda s: s.head_dim * (s.n_heads + 2 * s.n_kv_heads)))  # one per output column
QK_NORM = MODEL_PARTS.add(ModelPart(
    "qk_norm", "Q and K head norms", in_attention=True,
    replicated=lambda s: 2 * s.head_dim))  # one RMSNorm each
WINDOWS = MODEL_PARTS.add(ModelPart(
    "windows", "window layers"))  # config.json may set model.sliding_window and layer_types
SANDWICH_NORMS = MODEL_PARTS.add(ModelPart(
    "sandwich_norms", "sandwich norms",  # after the attention, after the MLP (Gemma)
    replicated=lambda s: 2 * s.dim))
NORM_OFFSET = MODEL_PARTS.add(ModelPart(
    "norm_offset", "norms scale by 1 + w"))  # w starts at zero (Gemma)
GELU_TANH = MODEL_PARTS.add(ModelPart(
    "gelu_tanh", "gated MLP with gelu_tanh"))  # GeGLU with tanh GELU, not SwiGLU (Gemma)
EMBED_SCALE = MODEL_PARTS.add(ModelPart(
    "embed_scale", "embedding scaled by sqrt(dim)"))
EXPERTS = MODEL_PARTS.add(ModelPart(
    "experts", "mixtures of experts"))  # counted in config/model_size.mlp_params
OUT_BIAS = MODEL_PARTS.add(ModelPart(
    "out_bias", "output projection bias", replicated=lambda s: s.dim, in_attention=True))
SINKS = MODEL_PARTS.add(ModelPart(
    "sinks", "attention sinks", sharded=lambda s: s.n_heads,  # a logit per query head
    in_attention=True))
ROUTER_BIAS = MODEL_PARTS.add(ModelPart(
    "router_bias", "router bias"))  # counted in config/model_size.mlp_params
EXPERT_BIAS = MODEL_PARTS.add(ModelPart(
    "expert_bias", "expert biases"))  # 2 F_e + D per expert: config/model_size.expert_params
OUTPUT_GATE = MODEL_PARTS.add(ModelPart(
    "output_gate", "attention output gated by sigmoid", in_attention=True,
    sharded=lambda s: s.dim * s.n_heads * s.head_dim))  # a gate per query dimension
SHARED_EXPERT = MODEL_PARTS.add(ModelPart(
    "shared_expert", "a shared expert gated by sigmoid"))  # counted in model_size.mlp_params
LINEAR_ATTENTION = MODEL_PARTS.add(ModelPart(
    "linear_attention", "Gated DeltaNet layers"))  # counted in config/model_size.mixer_params
