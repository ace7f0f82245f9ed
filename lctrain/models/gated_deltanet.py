"""Gated DeltaNet, the linear-attention token mixer of hybrid models (Qwen3.5, Qwen3-Next: three
of these layers before each full-attention one; docs/parallelism.md §31). Single-device code.

x [B, S, D] -> Q, K, V (one projection), the output gate Z, β and the decay's input a (one each
per value head); a causal depthwise convolution of kernel k over Q, K, V with SiLU; the gated
delta rule (`lctrain.attention.delta_rule`) with β = sigmoid(b) and the log decay
g = -exp(A_log) softplus(a + dt_bias); per value head an RMSNorm of the output gated by
SiLU(Z); the output projection. Packed documents (doc_ids) restart both the convolution's
window and the recurrent state at every document's first token. Parameter names are
transformers' (`in_proj_qkv`, `conv1d`, `A_log`, ...), so Hugging Face weights map one to one.

The convolution and the recurrence run through the mixer's core (`LinearCore`), as attention
runs through the attention core: `LOCAL_LINEAR` on one device, and under context parallelism
`lctrain.attention.delta_cp.StatePassing` (the convolution's halo and the states come from
the ranks before). doc_ids are then the global [B, S] ids, as the attention core gets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lctrain.attention.delta_rule import LinearHeads, gated_delta_mix
from lctrain.models.init import ZEROS


@dataclass(frozen=True)
class LinearShape:
    """The sizes of a Gated DeltaNet layer (config.json's `linear_*` keys)."""

    dim: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float

    @property
    def heads(self) -> LinearHeads:
        return LinearHeads(self.key_heads, self.key_dim, self.value_heads, self.value_dim)

    @property
    def conv_channels(self) -> int:
        """Q, K and V's channels, which the convolution mixes one by one."""
        return self.heads.channels


class LinearCore(Protocol):
    """How a Gated DeltaNet layer mixes over the sequence: its tokens' projected Q, K, V
    [B, S_local, C] (before the convolution), log decays g and write strengths beta
    [B, S_local, H_v], and the global document ids [B, S] (or None: one document per row) ->
    the gated delta rule's output [B, S_local, H_v, d_v] as over the whole rows."""

    def mix(self, qkv: Tensor, weight: Tensor, g: Tensor, beta: Tensor,
            doc_ids: Tensor | None, heads: LinearHeads) -> Tensor: ...


class LocalLinear:
    """One device holds the whole rows."""

    def mix(self, qkv: Tensor, weight: Tensor, g: Tensor, beta: Tensor,
            doc_ids: Tensor | None, heads: LinearHeads) -> Tensor:
        docs = None if doc_ids is None else doc_ids.to(qkv.device)
        return gated_delta_mix(qkv, weight, g, beta, docs, heads)


LOCAL_LINEAR = LocalLinear()


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output scaled by w, then times SiLU(z): transformers'
    `Qwen3_5RMSNormGated` arithmetic (normalise in float32, scale in the input dtype, gate in
    float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(wide)
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (y * F.silu(z.to(wide))).to(x.dtype)

    def init_rules(self) -> dict[str, float | None]:
        return {"weight": None}


class GatedDeltaNet(nn.Module):
    """The mixer: `forward(x, *, cos, sin, doc_ids)` as the attention's (RoPE unused)."""

    def __init__(self, shape: LinearShape, init_std: float, out_std: float,
                 core: LinearCore = LOCAL_LINEAR):
        super().__init__()
        self.shape, self.core = shape, core
        s = shape
        self.make_projections()
        self.conv1d = nn.Conv1d(s.conv_channels, s.conv_channels, s.conv_kernel,
                                groups=s.conv_channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.value_heads))
        self.norm = GatedRMSNorm(s.value_dim, s.eps)
        self.out_proj = nn.Linear(s.value_heads * s.value_dim, s.dim, bias=False)
        self.std, self.out_std = init_std, out_std

    def make_projections(self) -> None:
        """The input projections: Q, K and V (`in_proj_qkv`, [Q of every key head; K; V]), Z,
        b and a, each its own."""
        s = self.shape
        self.in_proj_qkv = nn.Linear(s.dim, s.conv_channels, bias=False)
        self.in_proj_z = nn.Linear(s.dim, s.value_heads * s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.dim, s.value_heads, bias=False)
        self.in_proj_a = nn.Linear(s.dim, s.value_heads, bias=False)

    def projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, S, D] -> (Q, K, V [B, S, C] in the convolution's channel order, Z
        [B, S, H_v d_v], b and a [B, S, H_v])."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: Tensor, *, cos: Tensor | None = None, sin: Tensor | None = None,
                doc_ids: Tensor | None = None) -> Tensor:
        s = self.shape
        b, n, _ = x.shape
        qkv, z, beta, a = self.projections(x)
        beta = torch.sigmoid(beta)
        wide = torch.promote_types(a.dtype, torch.float32)  # A could overflow in half precision
        g = -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias)
        out = self.core.mix(qkv, self.conv1d.weight, g, beta, doc_ids, s.heads)
        z = z.reshape(b, n, s.value_heads, s.value_dim)
        return self.out_proj(self.norm(out, z).reshape(b, n, -1))

    def init_rules(self) -> dict[str, float | None]:
        # the output projection feeds the residual stream: scaled down by depth; dt_bias ones
        # and A_log zeros start every head at g = -softplus(a + 1)
        projections = {f"{name}.weight": self.std for name, module in self.named_children()
                       if name.startswith("in_proj_")}
        return {**projections, "conv1d.weight": self.std / math.sqrt(self.shape.conv_kernel),
                "dt_bias": None, "A_log": ZEROS, "out_proj.weight": self.out_std}


class GroupedGatedDeltaNet(GatedDeltaNet):
    """The mixer with Qwen3-Next's fused projections, rows grouped by key head:
    `in_proj_qkvz` gives for each key head its Q (d_k), K (d_k), then the V and Z of its
    r = H_v / H_k value heads (r d_v each); `in_proj_ba` for each key head its r b's, then its
    r a's. The forward regroups them into the convolution's channel order (every Q, every K,
    every V) and computes as `GatedDeltaNet`."""

    def make_projections(self) -> None:
        s = self.shape
        self.in_proj_qkvz = nn.Linear(s.dim, s.conv_channels + s.value_heads * s.value_dim,
                                      bias=False)
        self.in_proj_ba = nn.Linear(s.dim, 2 * s.value_heads, bias=False)

    def projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = self.shape
        b, n, _ = x.shape
        r = s.value_heads // s.key_heads
        per_head = self.in_proj_qkvz(x).view(b, n, s.key_heads, -1)
        q, k, v, z = per_head.split([s.key_dim, s.key_dim, r * s.value_dim, r * s.value_dim],
                                    dim=-1)
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
        beta, a = self.in_proj_ba(x).view(b, n, s.key_heads, 2 * r).split([r, r], dim=-1)
        return qkv, z.flatten(2), beta.flatten(2), a.flatten(2)
