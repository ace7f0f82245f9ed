"""The generic single-device decoder every registered family builds (`Decoder`: Llama's
architecture as the base, RMSNorm, RoPE, GQA, a gated MLP or a mixture of experts; a family
brings its own attention block and experts, and its flags switch the rest: its entries in
`lctrain.config.model_families` and `lctrain.models.registry`). Plain model code: tensor parallelism, activation checkpointing and
data parallelism are applied to it from outside (`lctrain.parallel.parallelize`), and the
untouched model is every test's reference.

Parameter names follow torchtitan (`tok_embeddings`, `layers.{i}.attention.wq`, ...); layers live
in a ModuleDict keyed by their global id so that a pipeline split deletes modules without
renaming checkpoint keys. `forward` tolerates a missing embedding (input is then a hidden state)
and a missing output layer (the hidden state is returned). RoPE uses the "rotate half" layout of
Hugging Face Llama, so HF weights map one to one (see `lctrain.models.hf`).

The attention core is a callable stored on each attention module: `core(q, k, v, doc_ids) ->
out` with q [B, S, H, d], k, v [B, S, H_kv, d], causal, scale 1/sqrt(d), and doc_ids [B, S_global]
(or None) marking packed documents that must not attend to each other. Context-parallel
algorithms plug in there (`lctrain.attention.ContextParallelAttention`); S is then this rank's
share of the sequence. Every module says how its parameters start (`init_rules`); the values come
from lctrain.models.init, the same for every layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from lctrain.attention.calls import effective_window, local_block
from lctrain.attention.local import local_attention
from lctrain.config import ModelConfig
from lctrain.config.model_families import NORM_TILE_ELEMENTS, model_family
from lctrain.data.batch import IGNORE_INDEX
from lctrain.models.init import ZEROS, init_weights
from lctrain.models.moe import Experts, MoE, RouterLog, load_balancing_loss
from lctrain.models.rope import rope_frequencies

AttentionCore = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
LossHead = Callable[[nn.Module, Tensor, Tensor], Tensor]
"""(output layer, final hidden state [B, S, D], labels [B, S]) -> sum of token losses."""


def cross_entropy_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of the cross-entropies of the valid targets (labels != IGNORE_INDEX), in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def full_logits_loss(output: nn.Module, h: Tensor, labels: Tensor) -> Tensor:
    """The loss head that computes every logit at once."""
    return cross_entropy_sum(output(h), labels)


def _same(x: Tensor) -> Tensor:
    return x


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


def _row_tiles(rows: int, dim: int):
    """Slices of `rows` rows of `dim` elements, `NORM_TILE_ELEMENTS` elements each at most."""
    step = max(1, NORM_TILE_ELEMENTS // dim)
    return (slice(start, start + step) for start in range(0, rows, step))


class _RMSNormRows(torch.autograd.Function):
    """RMSNorm over the last dimension, Hugging Face's arithmetic (normalise in float32, scale
    by w in the input dtype, or by 1 + w in float32), row tile by row tile
    (`NORM_TILE_ELEMENTS`), so its float32 working tensors are a tile each whatever the
    sequence length: the same expression over the whole input holds up to two float32 copies
    of it in the forward and seven in autograd's backward (64 GiB for an 8B model's 600K
    tokens). It keeps for the backward its input, w and each row's float32 rsqrt, and the
    backward recomputes the normalised rows."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: bool) -> Tensor:
        dim = x.shape[-1]
        xs = x.reshape(-1, dim)
        out = torch.empty(xs.shape, dtype=x.dtype if offset else
                          torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(xs.shape[0], 1, dtype=torch.float32, device=x.device)
        for tile in _row_tiles(xs.shape[0], dim):
            xf = xs[tile].float()
            rstd[tile] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = xf * rstd[tile]
            out[tile] = (y * (1.0 + weight.float())).to(x.dtype) if offset else \
                weight * y.to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return out.view(*x.shape[:-1], dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        xs, gs = x.reshape(-1, dim), grad.reshape(-1, dim)
        scale = weight.float() + 1.0 if ctx.offset else weight.float()
        gx = torch.empty_like(xs)
        gw = torch.zeros(dim, dtype=torch.float32, device=x.device)
        for tile in _row_tiles(xs.shape[0], dim):
            y, g = xs[tile].float() * rstd[tile], gs[tile].float()
            # w's gradient: the output's, times what w scaled (in the input dtype without offset)
            gw += (g * (y if ctx.offset else y.to(x.dtype).float())).sum(0)
            gy = g * scale
            # d/dx of x * rsqrt(mean(x^2) + eps): rsqrt * (gy - y * mean(gy * y))
            gx[tile] = (rstd[tile] * (gy - y * (gy * y).mean(-1, keepdim=True))).to(x.dtype)
        return gx.view_as(x), gw.to(weight.dtype), None, None


class RMSNorm(nn.Module):
    """RMSNorm scaled by its weight w, or by 1 + w with `offset` (Gemma; w starts at zero)."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 (as HF Llama does), scale in the input dtype (Gemma: scale in
        # float32 too, as HF Gemma does). Under autocast the output is in the compute dtype:
        # the projections that read it then share one copy instead of each casting its own.
        if isinstance(x, DTensor):  # sequence parallel: each rank normalises its own rows
            mesh_dims = self.weight.device_mesh.ndim  # w's gradient: this rank's rows' part
            weight = self.weight.to_local(grad_placements=[Partial()] * mesh_dims)
            out = _RMSNormRows.apply(x.to_local(), weight, self.eps, self.offset)
            out = DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
        else:
            out = _RMSNormRows.apply(x, self.weight, self.eps, self.offset)
        if torch.is_autocast_enabled(x.device.type):
            out = out.to(torch.get_autocast_dtype(x.device.type))
        return out

    def init_rules(self) -> dict[str, float | None]:
        return {"weight": ZEROS if self.offset else None}  # a scale of one either way


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions, computed in float32 like HF, cast to the input dtype.

    Frequencies come from `lctrain.models.rope` (theta and the optional context-extension
    scaling).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_scaling = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Compute the frequencies again (a model built on the meta device has none)."""
        self.inv_freq = rope_frequencies(self.cfg)[0].to(self.inv_freq.device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions [B or 1, S] -> cos, sin [B or 1, S, 1, d]
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Llama's attention: Q, K, V projections (with biases where the family has them:
    `ModelFamily.qkv_bias`, Qwen2), RoPE, the core, the output projection. A family changes
    it by overriding `head_norms`. `window`: the sliding window of a window layer (set by the
    block from model.layer_types), passed to the core."""

    def __init__(self, cfg: ModelConfig, core: AttentionCore = sdpa_attention):
        super().__init__()
        family = model_family(cfg.family)
        qkv_bias = family.qkv_bias
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_head
        self.wq = nn.Linear(cfg.dim, cfg.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.dim, bias=family.out_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads)) if family.sinks else None
        """A sink logit per query head (`ModelFamily.sinks`), passed to the core."""
        self.std, self.out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.core = core
        """The attention core (local SDPA or a context-parallel algorithm)."""
        self.window: int | None = None
        # the core scales scores by d^-1/2; another scale (query_pre_attn_scalar) goes into q
        self.q_scale = (None if cfg.query_pre_attn_scalar is None
                        else math.sqrt(self.head_dim / cfg.query_pre_attn_scalar))

    def forward(self, x: Tensor, *, cos: Tensor, sin: Tensor,
                doc_ids: Tensor | None = None) -> Tensor:
        b, s, _ = x.shape
        # Head counts come from the weights so that TP-sharded projections work unchanged.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = self.head_norms(q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks
        sink = {} if sinks is None else {"sink": sinks}  # this rank's heads' under TP
        out = self.core(q, k, v, doc_ids, window=self.window, **sink)  # [B, S, H, d]
        return self.wo(out.reshape(b, s, -1))

    def head_norms(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q [B, S, H, d], k [B, S, H_kv, d] before RoPE: Llama leaves them as they are."""
        return q, k

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
    """The gated MLPs' activation of the family (`ModelFamily.mlp_activation`)."""
    return _gelu_tanh if model_family(cfg.family).mlp_activation == "gelu_tanh" else F.silu


class FeedForward(nn.Module):
    """The gated MLP: w2(act(w1 x) * w3 x), act silu (SwiGLU) or tanh GELU (GeGLU:
    `ModelFamily.mlp_activation`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = mlp_activation(cfg)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.std, self.out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.activation(self.w1(x)) * self.w3(x))

    def init_rules(self) -> dict[str, float | None]:
        # the down projection feeds the residual stream: scaled down by depth
        return {"w1.weight": self.std, "w3.weight": self.std, "w2.weight": self.out_std}


class TransformerBlock(nn.Module):
    """Norm, attention, residual add; norm, MLP (dense, or a mixture of experts recording its
    routing in `router_log`), residual add. A `sandwich_norms` family normalises the
    attention's and the MLP's outputs too, before each add (Gemma)."""

    def __init__(self, cfg: ModelConfig, core: AttentionCore = sdpa_attention,
                 attention: Callable[..., Attention] = Attention, layer: int = 0,
                 router_log: RouterLog | None = None,
                 experts: Callable[..., Experts] = Experts):
        super().__init__()
        family = model_family(cfg.family)
        offset = family.norm_offset
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, offset)
        self.attention = attention(cfg, core)
        self.attention.window = cfg.layer_window(layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, offset)
        self.feed_forward = (MoE(cfg, experts(cfg, mlp_activation(cfg)), layer, router_log,
                                 family.router_bias)
                             if cfg.is_moe_layer(layer) else FeedForward(cfg))
        if family.sandwich_norms:
            self.attention_out_norm = RMSNorm(cfg.dim, cfg.norm_eps, offset)
            self.ffn_out_norm = RMSNorm(cfg.dim, cfg.norm_eps, offset)
        self.sandwich = family.sandwich_norms

    def forward(self, x: Tensor, *, cos: Tensor, sin: Tensor,
                doc_ids: Tensor | None = None) -> Tensor:
        a = self.attention(self.attention_norm(x), cos=cos, sin=sin, doc_ids=doc_ids)
        h = x + (self.attention_out_norm(a) if self.sandwich else a)
        f = self.feed_forward(self.ffn_norm(h))
        return h + (self.ffn_out_norm(f) if self.sandwich else f)


class Decoder(nn.Module):
    """The decoder: embedding, blocks, final norm, output layer. `attention` builds each
    block's attention (`Attention`, or a family's: `lctrain.models.registry.new_model`), and
    `experts` each mixture-of-experts layer's experts (`Experts`, or a family's)."""


    def __init__(self, cfg: ModelConfig, core: AttentionCore = sdpa_attention,
                 attention: Callable[..., Attention] = Attention,
                 experts: Callable[..., Experts] = Experts):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        family = model_family(cfg.family)
        self.rope = RotaryEmbedding(cfg)
        self.rope_local = (None if cfg.rope_local_theta is None else RotaryEmbedding(
            dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_type="default")))
        """The sliding layers' RoPE, when it differs (model.rope_local_theta: Gemma 3)."""
        self.local_rope_layers = {str(i) for i in range(cfg.n_layers)
                                  if self.rope_local is not None and cfg.layer_window(i)}
        self.embed_scale = math.sqrt(cfg.dim) if family.embed_scale else None
        self.router_log = RouterLog()
        """The MoE layers' routing of the current forward (lctrain.models.moe)."""
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, core, attention, i,
                                                              self.router_log, experts)
                                     for i in range(cfg.n_layers)})
        self.reduce_router_stats: Callable[[Tensor], Tensor] = _same
        """Sum over the ranks that hold parts of the micro-batch's tokens (context parallelism
        sets it), with the gradient passed through unchanged: each of those ranks adds the same
        load-balancing loss, and its own tokens' part of the gradient."""
        self.aux_loss: Tensor | None = None
        """The load-balancing loss of the last forward with labels (MoE models; §28)."""
        self.expert_counts: Tensor | None = None
        """Tokens this rank routed to each expert in the last forward with labels, [MoE layers,
        E] (float, no gradient)."""
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps, family.norm_offset)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.loss_head: LossHead = full_logits_loss
        """How the loss is computed from the final hidden state (the sequence-tiled head of
        lctrain.parallel.tiling plugs in here)."""

    def forward(self, x: Tensor, positions: Tensor | None = None,
                doc_ids: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        """tokens [B, S] (or hidden [B, S, D] without an embedding) -> logits [B, S, V], or with
        `labels` [B, S] the sum of the token cross-entropies (IGNORE_INDEX targets left out),
        with `labels` [G, B, S] the G sums of G label sets over the one forward (the
        validation loss by position band).

        positions: RoPE position ids [B or 1, S] (default 0..S-1); with context parallelism the
        global positions of this rank's tokens. doc_ids: see the module docstring.
        """
        if positions is None:  # from the input: with sequence parallelism h holds S/tp tokens
            positions = torch.arange(x.shape[1], device=x.device)[None]
        h = x
        self.router_log.clear()
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.embed_scale is not None:  # in the embedding's dtype, as HF Gemma rounds it
                h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        dtype = (h.dtype if not torch.is_autocast_enabled(h.device.type)
                 else torch.get_autocast_dtype(h.device.type))
        cos, sin = self.rope(positions, dtype)
        local = self.rope_local(positions, dtype) if self.local_rope_layers else (cos, sin)
        for name, layer in self.layers.items():
            c, s = local if name in self.local_rope_layers else (cos, sin)
            h = layer(h, cos=c, sin=s, doc_ids=doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if labels is not None and self.router_log.counts:
            self._router_losses()
        if self.output is None:
            return h
        if labels is None:
            return self.output(h)
        if labels.dim() == 3:  # several label sets over one forward: one loss sum each
            return torch.stack([self.loss_head(self.output, h, group) for group in labels])
        return self.loss_head(self.output, h, labels)

    def _router_losses(self) -> None:
        """`aux_loss` and `expert_counts` from the forward's routing (§28)."""
        self.aux_loss = self.aux_from_totals(self.router_totals())

    def router_totals(self) -> Tensor:
        """The forward's routing summed over its MoE layers, [2 E + 1]: the tokens sent to each
        expert and the routing probabilities of each (with their gradient), then the rows;
        sets `expert_counts` and clears the log."""
        log = self.router_log
        self.expert_counts = torch.stack([log.counts[i] for i in sorted(log.counts)])
        rows = torch.full((1,), float(log.tokens), device=self.expert_counts.device)
        totals = torch.cat([self.expert_counts.sum(dim=0), torch.stack(log.prob_sums).sum(dim=0),
                            rows])
        log.clear()
        return totals

    def aux_from_totals(self, totals: Tensor) -> Tensor:
        """The load-balancing loss of `router_totals` (summed over the layers of every pipeline
        stage), once they are summed over the ranks that hold the micro-batch's tokens; the
        gradient reaches the probabilities only."""
        e = self.cfg.n_experts
        totals = self.reduce_router_stats(totals)
        return load_balancing_loss(totals[:e].detach(), totals[e:2 * e], totals[-1].detach(), e)

    def init_rules(self) -> dict[str, float | None]:
        rules = {}
        if self.tok_embeddings is not None:
            rules["tok_embeddings.weight"] = self.cfg.init_std
        if self.output is not None:  # tied: the embedding's rule, already drawn
            rules["output.weight"] = self.cfg.init_std
        return rules

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`, the same global weights for every layout (each
        parameter has its own random streams: lctrain.models.init): normal(init_std) for the
        embedding, the output layer and the input projections, init_std / sqrt(2 n_layers) for
        the projections that feed the residual stream, ones for the norms, zeros for
        biases."""
        init_weights(self, seed)
