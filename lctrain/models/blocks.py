"""A decoder block, composed: norm, a token mixer, residual add; norm, a feed-forward, residual
add. Each layer's token mixer comes from `TOKEN_MIXERS` by the layer's type
(`model.layer_types`: full or sliding attention, or a Gated DeltaNet) and its feed-forward from
`FEED_FORWARDS` (`model.moe_layers`: a gated MLP or a mixture of experts); the family's parts
(`lctrain.models.parts`) add their modules to the block and its attention and act at their
seams. Plain single-device code: parallelism is applied from `lctrain.parallel`.

The attention core is a callable the attention module holds: `core(q, k, v, doc_ids, window=,
sink=) -> out` with q [B, S, H, d], k, v [B, S, H_kv, d], causal, scale 1/sqrt(d), and doc_ids
[B, S_global] (or None) marking packed documents that must not attend to each other.
Context-parallel algorithms plug in there (`lctrain.attention.ContextParallelAttention`); S is
then this rank's share of the sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lctrain.attention.calls import effective_window, local_block
from lctrain.attention.local import local_attention
from lctrain.config import ModelConfig
from lctrain.config.model_families import model_family
from lctrain.config.model_parts import (
    GELU_TANH,
    NORM_OFFSET,
    OUT_BIAS,
    QKV_BIAS,
    ROUTER_BIAS,
    SHARED_EXPERT,
)
from lctrain.config.registry import Registry
from lctrain.config.schema import FULL, LINEAR, SLIDING
from lctrain.models.gated_deltanet import (
    LOCAL_LINEAR,
    GatedDeltaNet,
    LinearCore,
    LinearShape,
)
from lctrain.models.init import ZEROS
from lctrain.models.moe import Experts, MoE, RouterLog
from lctrain.models.norms import RMSNorm
from lctrain.models.parts import Part
from lctrain.models.rope import apply_rotary

AttentionCore = Callable[..., Tensor]
"""(q, k, v, doc_ids, window=, sink=) -> out: see the module docstring."""


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None,
                   window: int | None = None, sink: Tensor | None = None) -> Tensor:
    """Local causal attention. [B, S, H, d] x [B, S, H_kv, d] -> [B, S, H, d].

    PyTorch SDPA without documents, window or sinks; otherwise the position-aware kernels of
    lctrain.attention (they skip what the document mask and the window hide, and merge the
    sinks: docs/parallelism.md §26).
    """
    window = effective_window(window, q.shape[1])
    if doc_ids is not None or window is not None or sink is not None:
        block = local_block(q.shape[1], doc_ids)
        return local_attention(q, k, v, block, block, causal=True, scale=q.shape[-1] ** -0.5,
                               window=window, sink=sink)[0]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


@dataclass(frozen=True)
class BlockParts:
    """What a block is built from besides the config: the attention core, the family's parts'
    code, its experts' class, the model's router log, the linear-attention layers' core and
    the family's linear mixer class."""

    core: AttentionCore = sdpa_attention
    parts: tuple[Part, ...] = ()
    experts: Callable[..., Experts] = Experts
    router_log: RouterLog | None = None
    linear: LinearCore = LOCAL_LINEAR
    linear_mixer: Callable[..., GatedDeltaNet] = GatedDeltaNet


class Attention(nn.Module):
    """Llama's attention: Q, K, V projections (with biases in a `qkv_bias` family), the parts'
    seams on the heads (`Part.query`, `Part.qkv`), RoPE, the core, a gate on its output where a
    part makes one, the output projection (with a bias in an `out_bias` family). `window`: the
    sliding window of a window layer (model.layer_types), and `sinks`: a sink logit per query
    head where a part adds them; both go to the core."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, build: BlockParts = BlockParts()):
        super().__init__()
        family = model_family(cfg.family)
        qkv_bias = family.has(QKV_BIAS)
        self.head_dim = cfg.d_head
        self.wq = nn.Linear(cfg.dim, cfg.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.dim, bias=family.has(OUT_BIAS))
        self.sinks: nn.Parameter | None = None
        self.std, self.out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.core = build.core
        """The attention core (local SDPA or a context-parallel algorithm)."""
        self.window = cfg.layer_window(layer)
        # the core scales scores by d^-1/2; another scale (query_pre_attn_scalar) goes into q
        self.q_scale = (None if cfg.query_pre_attn_scalar is None
                        else math.sqrt(self.head_dim / cfg.query_pre_attn_scalar))
        self.parts = build.parts
        for part in self.parts:
            part.build_attention(self, cfg)

    def forward(self, x: Tensor, *, cos: Tensor, sin: Tensor,
                doc_ids: Tensor | None = None) -> Tensor:
        b, s, _ = x.shape
        # Head counts come from the weights so that TP-sharded projections work unchanged.
        q, gate = self.wq(x).view(b, s, -1, self.head_dim), None
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        for part in self.parts:  # every part's queries (and gate) before any part's heads
            q, made = part.query(self, q)
            gate = made if made is not None else gate
        for part in self.parts:
            q, k, v = part.qkv(self, q, k, v)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks
        sink = {} if sinks is None else {"sink": sinks}  # this rank's heads' under TP
        out = self.core(q, k, v, doc_ids, window=self.window, **sink)  # [B, S, H, d]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(b, s, -1))

    def init_rules(self) -> dict[str, float | None]:
        # the output projection feeds the residual stream: scaled down by depth
        rules = {"wq.weight": self.std, "wk.weight": self.std, "wv.weight": self.std,
                 "wo.weight": self.out_std}
        if self.wq.bias is not None:
            rules.update({"wq.bias": ZEROS, "wk.bias": ZEROS, "wv.bias": ZEROS})
        if self.wo.bias is not None:
            rules["wo.bias"] = ZEROS
        if self.sinks is not None:
            rules["sinks"] = self.std
        return rules


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def mlp_activation(cfg: ModelConfig) -> Callable[[Tensor], Tensor]:
    """The gated MLPs' activation of the family: SiLU, or tanh GELU with the `gelu_tanh` part."""
    return _gelu_tanh if model_family(cfg.family).has(GELU_TANH) else F.silu


class FeedForward(nn.Module):
    """The gated MLP: w2(act(w1 x) * w3 x), act silu (SwiGLU) or tanh GELU (GeGLU: a
    `gelu_tanh` family), of hidden width model.ffn_dim (or `width`: a shared expert's)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, build: BlockParts = BlockParts(),
                 width: int | None = None):
        super().__init__()
        self.activation = mlp_activation(cfg)
        width = width or cfg.ffn_dim
        self.w1 = nn.Linear(cfg.dim, width, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, width, bias=False)  # up
        self.w2 = nn.Linear(width, cfg.dim, bias=False)  # down
        self.std, self.out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.activation(self.w1(x)) * self.w3(x))

    def init_rules(self) -> dict[str, float | None]:
        # the down projection feeds the residual stream: scaled down by depth
        return {"w1.weight": self.std, "w3.weight": self.std, "w2.weight": self.out_std}


def mixture_of_experts(cfg: ModelConfig, layer: int = 0, build: BlockParts = BlockParts()) -> MoE:
    """A mixture of experts (`lctrain.models.moe`) with the family's experts (and its shared
    expert, of model.shared_expert_ffn_dim), recording its routing in the model's router
    log."""
    family = model_family(cfg.family)
    shared = (FeedForward(cfg, layer, build, cfg.shared_expert_ffn_dim)
              if family.has(SHARED_EXPERT) else None)
    return MoE(cfg, build.experts(cfg, mlp_activation(cfg)), layer, build.router_log,
               family.has(ROUTER_BIAS), shared)


@dataclass(frozen=True)
class TokenMixer:
    name: str
    layer_types: tuple[str, ...]
    """The values of `model.layer_types` whose layers it mixes."""
    module: str
    """The block's attribute that holds it (the checkpoints' name)."""
    build: Callable[[ModelConfig, int, BlockParts], nn.Module]
    """(config, layer, block parts) -> the module: `forward(x, *, cos, sin, doc_ids)`."""


@dataclass(frozen=True)
class FeedForwardKind:
    name: str
    build: Callable[[ModelConfig, int, BlockParts], nn.Module]
    """(config, layer, block parts) -> the module: `forward(x)`."""


def gated_deltanet(cfg: ModelConfig, layer: int = 0,
                   build: BlockParts = BlockParts()) -> GatedDeltaNet:
    """A linear-attention layer's mixer (`lctrain.models.gated_deltanet`, the family's class) of
    the model's sizes."""
    shape = LinearShape(cfg.dim, cfg.linear_key_heads, cfg.linear_value_heads,
                        cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_conv_kernel,
                        cfg.norm_eps)
    return build.linear_mixer(shape, cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers),
                              build.linear)


TOKEN_MIXERS: Registry[TokenMixer] = Registry("token mixer")
TOKEN_MIXERS.add(TokenMixer("attention", (FULL, SLIDING), "attention", Attention))
TOKEN_MIXERS.add(TokenMixer("gated_deltanet", (LINEAR,), "linear_attention", gated_deltanet))
FEED_FORWARDS: Registry[FeedForwardKind] = Registry("feed-forward")
FEED_FORWARDS.add(FeedForwardKind("dense", FeedForward))
FEED_FORWARDS.add(FeedForwardKind("experts", mixture_of_experts))


def token_mixer(cfg: ModelConfig, layer: int) -> TokenMixer:
    """The mixer of layer `layer`'s type."""
    kind = cfg.layer_type(layer)
    (mixer,) = [TOKEN_MIXERS[name] for name in TOKEN_MIXERS
                if kind in TOKEN_MIXERS[name].layer_types]
    return mixer


def feed_forward_kind(cfg: ModelConfig, layer: int) -> FeedForwardKind:
    return FEED_FORWARDS["experts" if cfg.is_moe_layer(layer) else "dense"]


class Block(nn.Module):
    """Norm, token mixer, residual add; norm, feed-forward, residual add; the parts' seams on
    each sublayer's output (`Part.mixer_out`, `Part.ffn_out`: Gemma's sandwich norms)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, build: BlockParts = BlockParts()):
        super().__init__()
        offset = model_family(cfg.family).has(NORM_OFFSET)
        mixer = token_mixer(cfg, layer)
        self.mixer_name = mixer.module
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, offset)
        setattr(self, mixer.module, mixer.build(cfg, layer, build))
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, offset)
        self.feed_forward = feed_forward_kind(cfg, layer).build(cfg, layer, build)
        self.parts = build.parts
        for part in self.parts:
            part.build_block(self, cfg)

    @property
    def mixer(self) -> nn.Module:
        return self._modules[self.mixer_name]

    def forward(self, x: Tensor, *, cos: Tensor, sin: Tensor,
                doc_ids: Tensor | None = None) -> Tensor:
        a = self.mixer(self.attention_norm(x), cos=cos, sin=sin, doc_ids=doc_ids)
        for part in self.parts:
            a = part.mixer_out(self, a)
        h = x + a
        f = self.feed_forward(self.ffn_norm(h))
        for part in self.parts:
            f = part.ffn_out(self, f)
        return h + f
