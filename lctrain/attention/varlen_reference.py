"""A plain-torch variable-length attention kernel with flash-attn's varlen conventions, so that
the varlen path (packing, index maps, lse handling) runs and is tested on the CPU.

Sequences are packed along dim 0: q [total_q, H, d], k/v [total_k, H_kv, d], sequence i covering
rows cu_q[i]:cu_q[i+1] and cu_k[i]:cu_k[i+1]. Causal masks align to the bottom-right corner
(query j of n sees keys up to j + (m - n) of m), as in flash-attn >= 2.1. lse is [H, total_q]
float32 and +inf for a row that sees no key, with output 0. The backward takes the final
(merged) out and lse, as flash-attn's does.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _segments(cu_q: Tensor, cu_k: Tensor):
    for i in range(len(cu_q) - 1):
        yield (slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1])))


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Scores [H, n, m] of one sequence (KV heads repeated for GQA) and its visibility mask."""
    rep = q.shape[1] // k.shape[1]
    acc = _acc(q)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.repeat_interleave(rep, 1).to(acc)) * scale
    n, m = q.shape[0], k.shape[0]
    mask = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if causal:
        mask = mask.tril(m - n)
    return s.masked_fill(~mask, float("-inf")), mask


def varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor]:
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=_acc(q), device=q.device)
    rep = q.shape[1] // k.shape[1]
    for qs, ks in _segments(cu_q.cpu(), cu_k.cpu()):
        s, mask = _scores(q[qs], k[ks], scale, causal)
        seen = mask.any(-1)  # [n]
        row_lse = torch.logsumexp(s, -1)  # [H, n]; -inf where nothing is seen
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[qs] = torch.einsum("hqk,khd->qhd", p, v[ks].repeat_interleave(rep, 1).to(p.dtype)).to(
            q.dtype)
        lse[:, qs] = torch.where(seen, row_lse, float("inf"))
    return out, lse


def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    cu_q: Tensor, cu_k: Tensor, scale: float,
                    causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    acc = _acc(q)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    for qs, ks in _segments(cu_q.cpu(), cu_k.cpu()):
        s, _ = _scores(q[qs], k[ks], scale, causal)
        row_lse = lse[:, qs].to(acc)
        p = torch.exp(s - torch.where(torch.isfinite(row_lse), row_lse, 0.0)[..., None])
        p = p.masked_fill(~torch.isfinite(row_lse)[..., None], 0.0)  # [H, n, m]
        do = dout[qs].to(acc)
        dp = torch.einsum("qhd,khd->hqk", do, v[ks].repeat_interleave(rep, 1).to(acc))
        delta = (do * out[qs].to(acc)).sum(-1).t()  # [H, n]
        ds = p * (dp - delta[..., None])
        dq[qs] = torch.einsum("hqk,khd->qhd", ds, k[ks].repeat_interleave(rep, 1).to(acc)) * scale
        dk_full = torch.einsum("hqk,qhd->khd", ds, q[qs].to(acc)) * scale
        dv_full = torch.einsum("hqk,qhd->khd", p, do)
        dk[ks] = dk_full.view(dk_full.shape[0], -1, rep, dk_full.shape[-1]).sum(2)
        dv[ks] = dv_full.view(dv_full.shape[0], -1, rep, dv_full.shape[-1]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
