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
from functools import cache
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lctrain.attention.delta_rule import (
    DeltaRule,
    LinearHeads,
    chunk_gated_delta_rule,
    gated_delta_mix,
)
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


@dataclass(frozen=True)
class LocalLinear:
    """One device holds the whole rows; `rule`: the gated delta rule's code (lctrain's chunked
    torch, or fla's kernels: `lctrain.attention.delta_rule.delta_rule`)."""

    rule: DeltaRule = chunk_gated_delta_rule

    def mix(self, qkv: Tensor, weight: Tensor, g: Tensor, beta: Tensor,
            doc_ids: Tensor | None, heads: LinearHeads) -> Tensor:
        return gated_delta_mix(qkv, weight, g, beta, doc_ids, heads, self.rule)


LOCAL_LINEAR = LocalLinear()


@cache  # every layer and forward asks for the same
def grouped_to_qkv(heads: LinearHeads, width: int = 0) -> Tensor:
    """The convolution's channels (Q of every key head, then K, then V: the layout the linear
    cores read) as positions in a layout grouped by key head, each group its head's Q, K, its
    r = H_v / H_k value heads' V, then `width` more per group (Qwen3-Next's fused Z: r d_v;
    0 for none): [C] int64 on the host. Grouped layouts split over TP ranks by rows."""
    k, d_k, r = heads.key_heads, heads.key_dim, heads.value_heads // heads.key_heads
    v = r * heads.value_dim
    group = torch.arange(k)[:, None] * (2 * d_k + v + width)
    q = (group + torch.arange(d_k)).flatten()
    return torch.cat([q, q + d_k, (group + 2 * d_k + torch.arange(v)).flatten()])


class HeadNorm(nn.Module):
    """RMSNorm of each head's output [..., d_v] scaled by w: transformers'
    `Qwen3_5RMSNormGated` arithmetic before its gate (normalise in float32, scale in the input
    dtype); the mixer gates the result by SiLU(z) in float32. Under tensor parallelism its
    weight is replicated and the heads dimension is the sharded one (as for the attention's
    head norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
                              ).to(x.dtype)

    def init_rules(self) -> dict[str, float | None]:
        return {"weight": None}


def _local(t: Tensor) -> Tensor:
    """This rank's part of a parameter (sharded by heads under TP), with its gradient."""
    return t.to_local() if isinstance(t, DTensor) else t


class GatedDeltaNet(nn.Module):
    """The mixer: `forward(x, *, cos, sin, doc_ids)` as the attention's (RoPE unused).

    Its projection to Q, K, V (`in_proj_qkv`) and the convolution's kernels (`conv1d`) hold
    their rows grouped by key head (`grouped_to_qkv`), so that TP splits them by rows as it
    splits Z, b, a, dt_bias and A_log (by value heads) and the output projection's columns;
    the forward takes the channels to the cores' order (every Q, every K, every V) on this
    rank's heads, which it reads from the weights. Hugging Face's checkpoints hold in_proj_qkv
    and conv1d in the cores' order (`lctrain.models.hf` reorders them)."""

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
        self.norm = HeadNorm(s.value_dim, s.eps)
        self.out_proj = nn.Linear(s.value_heads * s.value_dim, s.dim, bias=False)
        self.std, self.out_std = init_std, out_std

    def make_projections(self) -> None:
        """The input projections: Q, K and V (`in_proj_qkv`, grouped by key head), Z, b and a
        (by value head), each its own."""
        s = self.shape
        self.in_proj_qkv = nn.Linear(s.dim, s.conv_channels, bias=False)
        self.in_proj_z = nn.Linear(s.dim, s.value_heads * s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.dim, s.value_heads, bias=False)
        self.in_proj_a = nn.Linear(s.dim, s.value_heads, bias=False)

    def projections(self, x: Tensor, heads: LinearHeads
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, S, D] -> (Q, K, V [B, S, C] in the cores' channel order, Z [B, S, H_v d_v], b
        and a [B, S, H_v]) of this rank's `heads`."""
        qkv = self.in_proj_qkv(x)
        order = grouped_to_qkv(heads).to(qkv.device)
        return (qkv.index_select(-1, order), self.in_proj_z(x), self.in_proj_b(x),
                self.in_proj_a(x))

    def local_heads(self) -> LinearHeads:
        """The heads this rank computes (all of them, or its share under TP), from the
        weights."""
        s = self.shape
        value_heads = _local(self.A_log).shape[0]
        return LinearHeads(value_heads * s.key_heads // s.value_heads, s.key_dim, value_heads,
                           s.value_dim)

    def forward(self, x: Tensor, *, cos: Tensor | None = None, sin: Tensor | None = None,
                doc_ids: Tensor | None = None) -> Tensor:
        b, n, _ = x.shape
        heads = self.local_heads()
        qkv, z, beta, a = self.projections(x, heads)
        beta = torch.sigmoid(beta)
        wide = torch.promote_types(a.dtype, torch.float32)  # A could overflow in half precision
        g = -_local(self.A_log).to(wide).exp() * F.softplus(a.to(wide) + _local(self.dt_bias))
        weight = _local(self.conv1d.weight).index_select(
            0, grouped_to_qkv(heads).to(qkv.device))
        out = self.core.mix(qkv, weight, g, beta, doc_ids, heads)
        z = z.reshape(b, n, heads.value_heads, heads.value_dim)
        gated = (self.norm(out) * F.silu(z.to(wide))).to(out.dtype)
        return self.out_proj(gated.reshape(b, n, -1))

    def init_rules(self) -> dict[str, float | None]:
        # the output projection feeds the residual stream: scaled down by depth; dt_bias ones
        # and A_log zeros start every head at g = -softplus(a + 1)
        projections = {f"{name}.weight": self.std for name, module in self.named_children()
                       if name.startswith("in_proj_")}
        return {**projections, "conv1d.weight": self.std / math.sqrt(self.shape.conv_kernel),
                "dt_bias": None, "A_log": ZEROS, "out_proj.weight": self.out_std}


class GroupedGatedDeltaNet(GatedDeltaNet):
    """The mixer with Qwen3-Next's fused projections, rows grouped by key head as its
    checkpoints hold them: `in_proj_qkvz` gives for each key head its Q (d_k), K (d_k), then
    the V and Z of its r = H_v / H_k value heads (r d_v each); `in_proj_ba` for each key head
    its r b's, then its r a's. The forward takes them to the cores' channel order and computes
    as `GatedDeltaNet`."""

    def make_projections(self) -> None:
        s = self.shape
        self.in_proj_qkvz = nn.Linear(s.dim, s.conv_channels + s.value_heads * s.value_dim,
                                      bias=False)
        self.in_proj_ba = nn.Linear(s.dim, 2 * s.value_heads, bias=False)

    def projections(self, x: Tensor, heads: LinearHeads
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        b, n, _ = x.shape
        r, d_v = heads.value_heads // heads.key_heads, heads.value_dim
        qkvz = self.in_proj_qkvz(x)
        qkv = qkvz.index_select(-1, grouped_to_qkv(heads, r * d_v).to(qkvz.device))
        z = qkvz.view(b, n, heads.key_heads, -1)[..., -r * d_v:].flatten(2)
        beta, a = self.in_proj_ba(x).view(b, n, heads.key_heads, 2 * r).split([r, r], dim=-1)
        return qkv, z, beta.flatten(2), a.flatten(2)
