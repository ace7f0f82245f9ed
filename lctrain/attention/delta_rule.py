"""The gated delta rule (Gated DeltaNet's token mixing, docs/parallelism.md §31) computed chunk
by chunk in plain torch, with packed documents: every document starts from a zero state.

Per value head a state S [d_k, d_v] is carried token by token:
    S_t = exp(g_t) S_{t-1} + k_t (β_t (v_t - (exp(g_t) S_{t-1})ᵀ k_t))ᵀ,   o_t = S_tᵀ q_t,
with q and k L2-normalised (q then scaled by d_k^-1/2), g_t <= 0 the log decay and β_t in (0, 1).
Chunks of C tokens turn the recurrence into matmuls (the WY/UT form: a unit lower-triangular
system per chunk), and a scan over chunks carries S. Documents enter as masks, never as a
different decay: within a chunk a token sees only the tokens of its own document, reads the
carried state only if it continues the document that state belongs to, and only the chunk's
last document writes the state the next chunk reads (§31 derives each mask).

Also the layer's causal depthwise convolution (`causal_conv`), which restarts at documents too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lctrain import device
from lctrain.attention.delta_fla import fla_gated_delta_rule, fla_installed
from lctrain.config.kernel_backends import LINEAR_KERNELS
from lctrain.config.model_size import DELTA_CHUNK

CHUNK = DELTA_CHUNK
"""Tokens per chunk of the scan: the triangular systems are C x C (the planner counts the
FLOPs of chunks of this size)."""
L2_EPS = 1e-6
"""The L2 normalisation's epsilon, as flash-linear-attention's kernels (and transformers) use."""


class LinearHeads(NamedTuple):
    """A Gated DeltaNet layer's heads: query/key heads of d_k, value heads of d_v (each key head
    serving value_heads / key_heads consecutive value heads)."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def channels(self) -> int:
        """The convolution's channels: Q, K, V side by side."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def split_heads(qkv: Tensor, heads: LinearHeads) -> tuple[Tensor, Tensor, Tensor]:
    """[B, S, C] (Q, K, V side by side) -> q, k [B, S, H_k, d_k], v [B, S, H_v, d_v]."""
    b, s, _ = qkv.shape
    keys = heads.key_heads * heads.key_dim
    q, k, v = qkv.split([keys, keys, heads.value_heads * heads.value_dim], dim=-1)
    return (q.reshape(b, s, heads.key_heads, heads.key_dim),
            k.reshape(b, s, heads.key_heads, heads.key_dim),
            v.reshape(b, s, heads.value_heads, heads.value_dim))


def gated_delta_mix(qkv: Tensor, weight: Tensor, g: Tensor, beta: Tensor,
                    doc_ids: Tensor | None, heads: LinearHeads,
                    rule: DeltaRule | None = None) -> Tensor:
    """A Gated DeltaNet layer's mixing over whole rows: the causal convolution of the projected
    Q, K, V [B, S, C], the heads, the gated delta rule (`rule`: `chunk_gated_delta_rule`'s
    contract; that function by default) -> [B, S, H_v, d_v]. doc_ids: on the host (or the
    device)."""
    on_device = None if doc_ids is None else doc_ids.to(qkv.device)
    q, k, v = split_heads(causal_conv(qkv, weight, on_device), heads)
    return (rule or chunk_gated_delta_rule)(q, k, v, g, beta, doc_ids)[0]


DeltaRule = Callable[..., tuple[Tensor, ...]]
"""The gated delta rule over rows (`chunk_gated_delta_rule`'s arguments and results): lctrain's
chunked torch code, or fla's kernels (`lctrain.attention.delta_fla`)."""


class RuleCode(NamedTuple):
    """A linear-attention kernel's code (its facts: `lctrain.config.kernel_backends`'s
    LINEAR_KERNELS entry of the same name)."""

    rule: DeltaRule
    installed: Callable[[], bool] = lambda: True


def delta_rule(kernel: str, on: torch.device) -> DeltaRule:
    """The rule train.linear_kernel names for a run on device `on`; `auto`: of the kernels that
    run there and whose code imports, the one `auto` ranks first (fla on CUDA where it is
    installed, else torch)."""
    if kernel == "auto":
        kind = "cuda" if device.gpu_path(on) else "cpu"
        kernel = min((LINEAR_KERNELS[n].auto_rank, n) for n in LINEAR_KERNELS
                     if LINEAR_KERNELS[n].device in ("any", kind)
                     and DELTA_RULES[n].installed())[1]
    return DELTA_RULES[kernel].rule


def l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _chunked(x: Tensor, chunk: int) -> Tensor:
    """[B, H, S, ...] (S a multiple of chunk) -> [B, H, S / chunk, chunk, ...]."""
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, *x.shape[3:])


def _chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, docs: Tensor
                 ) -> tuple[Tensor, ...]:
    """What each chunk contributes apart from the carried state (§31), for chunked
    q, k [B, H, N, C, d_k], v [B, H, N, C, d_v], g, beta [B, H, N, C] and docs [B, 1, N, C]:
    (U_v, W, the masked intra-chunk scores, the queries and keys that read and write the
    state, the state's carry factor [B, H, N, 1, 1])."""
    chunk, dtype = q.shape[-2], v.dtype
    cum = g.cumsum(dim=-1)  # log decay from the chunk's start to each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    visible = causal & (docs[..., :, None] == docs[..., None, :])  # i sees j: j <= i, same doc
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~visible, float("-inf")).exp()
    # the carried state belongs to the document of the token before the chunk (the row's first
    # document for the first chunk); a token reads it only if it continues that document
    before = torch.cat([docs[..., :1, :1], docs[..., :-1, -1:]], dim=-2)
    reads = (docs == before).to(dtype)  # [B, 1, N, C]
    writes = (docs == docs[..., -1:]).to(dtype)  # the chunk's last document writes the state

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower triangular once solved so
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * (cum.exp() * reads)[..., None],
                                      upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_state = q * (cum.exp() * reads)[..., None]
    k_state = k * ((cum[..., -1:] - cum).exp() * writes)[..., None]
    carry = (cum[..., -1].exp() * reads[..., -1])[..., None, None]  # [B, H, N, 1, 1]
    return u, w, intra, q_state, k_state, carry


def in_float32(fn):
    """`fn` with autocast off on its first argument's device: the recurrence's matmuls stay in
    float32 (bf16 autocast would otherwise run each chunk's products, the carried state's
    among them, in bf16 and keep bf16 copies of their operands)."""

    @functools.wraps(fn)
    def run(first, *args, **kwargs):
        on = (first[0] if isinstance(first, list) else first).device
        with torch.autocast(on.type, enabled=False):
            return fn(first, *args, **kwargs)

    return run


@in_float32
def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           doc_ids: Tensor | None = None, initial_state: Tensor | None = None,
                           chunk: int = CHUNK, transition: bool = False
                           ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """q, k [B, S, H_k, d_k], v [B, S, H, d_v] (each query/key head serves H / H_k consecutive
    value heads), g and beta [B, S, H], doc_ids [B, S] (None: one document per row),
    initial_state [B, H, d_k, d_v] continuing each row's first document (None: zeros) ->
    (output [B, S, H, d_v] in v's dtype, final state [B, H, d_k, d_v] of each row's last
    document), and with `transition` the matrix T [B, H, d_k, d_k] by which the final state
    depends on the initial one: final(S0) = T S0 + final(0) (zero when the row holds a
    document boundary; §31). Computed in float32 (float64 inputs stay float64), also under
    autocast."""
    b, s, h_k, d_k = k.shape
    h, out_dtype = v.shape[2], v.dtype
    if h != h_k:
        q, k = (x.repeat_interleave(h // h_k, dim=2) for x in (q, k))
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))
    q, k = l2norm(q) * d_k ** -0.5, l2norm(k)
    docs = (torch.zeros(b, s, dtype=torch.long, device=v.device) if doc_ids is None
            else doc_ids.to(v.device))
    pad = (chunk - s % chunk) % chunk
    if pad:  # zero keys, values and log decays: the state passes the padding unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
        docs = torch.cat([docs, docs[:, -1:].expand(b, pad)], dim=1)
    terms = _chunk_terms(*(_chunked(x, chunk) for x in (q, k, v, g, beta)),
                         docs.reshape(b, 1, -1, chunk))
    u, w, intra, q_state, k_state, carry = terms

    state = (torch.zeros(b, h, d_k, v.shape[-1], dtype=dtype, device=v.device)
             if initial_state is None else initial_state.to(dtype))
    eye = torch.eye(d_k, dtype=dtype, device=v.device)
    moved = eye.expand(b, h, d_k, d_k) if transition else None
    out = []
    for n in range(u.shape[2]):  # the chunks, in order
        v_new = u[:, :, n] - w[:, :, n] @ state
        out.append(q_state[:, :, n] @ state + intra[:, :, n] @ v_new)
        state = state * carry[:, :, n] + k_state[:, :, n].transpose(-1, -2) @ v_new
        if transition:  # the chunk maps S to (carry I - k_stateᵀ w) S + k_stateᵀ u
            moved = (eye * carry[:, :, n] - k_state[:, :, n].transpose(-1, -2) @ w[:, :, n]
                     ) @ moved
    o = torch.stack(out, dim=2).reshape(b, h, -1, v.shape[-1])[:, :, :s]
    o = o.transpose(1, 2).to(out_dtype)
    return (o, state, moved) if transition else (o, state)


@in_float32
def initial_states(ends: list[Tensor], transitions: list[Tensor], continues: list[Tensor],
                   first: Tensor | None = None) -> list[Tensor]:
    """The exact initial state of each stretch of a sequence, in sequence order (§31): each
    stretch computed from a zero state gave its final state `ends[j]` [B, H, d_k, d_v] and its
    `transitions[j]` [B, H, d_k, d_k]; `continues[j]` [B] says whether stretch j's first token
    continues the document of the token before it (for the first stretch: whether `first`,
    the state before the sequence, applies). Stretch j + 1 starts from
    T_j S_j + E_j where it continues a document, from zero where it starts one."""
    state = torch.zeros_like(ends[0]) if first is None else first
    out = []
    for end, moved, cont in zip(ends, transitions, continues, strict=True):
        state = state * cont.to(state.dtype)[:, None, None, None]
        out.append(state)
        state = moved @ state + end
    return out


def causal_conv(x: Tensor, weight: Tensor, doc_ids: Tensor | None) -> Tensor:
    """Depthwise causal convolution, x [B, S, C] with weight [C, 1, k] -> SiLU of [B, S, C]:
    token t mixes tokens t - k + 1 .. t of its own document (torch's conv1d with k - 1 zeros of
    left padding, restarted at each document)."""
    k = weight.shape[-1]
    out = x * weight[:, 0, k - 1]
    for shift in range(1, k):
        earlier = F.pad(x, (0, 0, shift, 0))[:, :x.shape[1]]  # token t - shift (zeros before)
        if doc_ids is not None:
            same = F.pad(doc_ids, (shift, 0), value=-1)[:, :x.shape[1]] == doc_ids
            earlier = earlier * same[..., None].to(x.dtype)
        out = out + earlier * weight[:, 0, k - 1 - shift]
    return F.silu(out)


DELTA_RULES: dict[str, RuleCode] = {"torch": RuleCode(chunk_gated_delta_rule),
                                    "fla": RuleCode(fla_gated_delta_rule, fla_installed)}
"""The code of each linear-attention kernel of `LINEAR_KERNELS`, by name."""
