"""A plain-torch variable-length attention kernel with flash-attn's varlen conventions, so that
the varlen path (packing, index maps, lse handling) runs and is tested on the CPU.

Sequences are packed along dim 0: q [total_q, H, d], k/v [total_k, H_kv, d], sequence i covering
rows cu_q[i]:cu_q[i+1] and cu_k[i]:cu_k[i+1]. Causal masks align to the bottom-right corner
(query j of n sees keys up to j + (m - n) of m), as in flash-attn >= 2.1, and so do windows
(left, right): query j sees keys j + m - n - left to j + m - n + right, -1 unbounded. lse is
[H, total_q] float32 and +inf for a row that sees no key, with output 0. The backward takes the
final (merged) out and lse, as flash-attn's does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lctrain.attention.calls import band_rows


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _segments(cu_q: Tensor, cu_k: Tensor):
    for i in range(len(cu_q) - 1):
        yield (slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1])))


def visible(n: int, m: int, causal: bool, band: tuple[int, int] | None = None,
            device: torch.device | None = None) -> Tensor:
    """Which of m keys each of n queries sees [n, m]: all, causal (bottom-right aligned), or
    the window `band` = (left, right) (flash's convention, -1 unbounded)."""
    if band is None:
        band = (-1, 0 if causal else -1)
    first, last = band_rows(n, m, band)
    j = torch.arange(m)
    return ((j >= first[:, None]) & (j <= last[:, None])).to(device)


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool,
            band: tuple[int, int] | None) -> tuple[Tensor, Tensor]:
    """Scores [H, n, m] of one sequence (KV heads repeated for GQA) and its visibility mask."""
    rep = q.shape[1] // k.shape[1]
    acc = _acc(q)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k.repeat_interleave(rep, 1).to(acc)) * scale
    mask = visible(q.shape[0], k.shape[0], causal, band, q.device)
    return s.masked_fill(~mask, float("-inf")), mask


def varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float,
                   causal: bool, band: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=_acc(q), device=q.device)
    rep = q.shape[1] // k.shape[1]
    for qs, ks in _segments(cu_q.cpu(), cu_k.cpu()):
        s, mask = _scores(q[qs], k[ks], scale, causal, band)
        seen = mask.any(-1)  # [n]
        row_lse = torch.logsumexp(s, -1)  # [H, n]; -inf where nothing is seen
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[qs] = torch.einsum("hqk,khd->qhd", p, v[ks].repeat_interleave(rep, 1).to(p.dtype)).to(
            q.dtype)
        lse[:, qs] = torch.where(seen, row_lse, float("inf"))
    return out, lse


def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    cu_q: Tensor, cu_k: Tensor, scale: float, causal: bool,
                    band: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    acc = _acc(q)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    for qs, ks in _segments(cu_q.cpu(), cu_k.cpu()):
        s, _ = _scores(q[qs], k[ks], scale, causal, band)
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


# ---- torch's flash-attention ops on the CPU, for tests and the GPU check's dry run ----------

HEAD_DIM_MAX = 256
"""The largest head dim flash attention's kernels take (a multiple of 8)."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"torch flash-attention contract: {what}")


def _check_operands(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None,
                    cu_k: Tensor | None, max_q: int, max_k: int) -> None:
    """The argument rules of `aten._flash_attention_forward` on CUDA, checked on the CPU."""
    dense = cu_q is None
    _check((cu_k is None) == dense, "cum_seq_q and cum_seq_k are both given or both None")
    _check(q.dim() == (4 if dense else 3), f"q is [B, S, H, d] dense or [total, H, d] varlen; "
                                           f"got {tuple(q.shape)} (varlen: {not dense})")
    _check(k.shape == v.shape and k.dim() == q.dim(), f"k {tuple(k.shape)} == v {tuple(v.shape)}")
    _check(q.dtype == k.dtype == v.dtype, "q, k, v share a dtype")
    _check(all(x.stride(-1) == 1 for x in (q, k, v)), "q, k, v have a contiguous last dim")
    h, hkv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    _check(k.shape[-1] == d and d % 8 == 0 and d <= HEAD_DIM_MAX,
           f"head dim {d} (k: {k.shape[-1]}) is a multiple of 8 up to {HEAD_DIM_MAX}")
    _check(h % hkv == 0, f"GQA: {hkv} kv heads divide {h} query heads")
    if dense:
        _check(q.shape[0] == k.shape[0] and (max_q, max_k) == (q.shape[1], k.shape[1]),
               f"dense: batch and max_q/max_k {(max_q, max_k)} match q {tuple(q.shape)}, "
               f"k {tuple(k.shape)}")
        return
    for cu, x, m, name in ((cu_q, q, max_q, "cum_seq_q"), (cu_k, k, max_k, "cum_seq_k")):
        _check(cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == q.device,
               f"{name} is int32 [n + 1] on q's device; got {cu.dtype} {tuple(cu.shape)} on "
               f"{cu.device}")
        lengths = cu.diff()
        _check(int(cu[0]) == 0 and int(cu[-1]) == x.shape[0] and bool((lengths >= 0).all()),
               f"{name} runs from 0 to {x.shape[0]}, non-decreasing; got {cu.tolist()}")
        _check(int(lengths.max()) <= m, f"max for {name} ({m}) >= its longest sequence")
    _check(len(cu_q) == len(cu_k), "cum_seq_q and cum_seq_k count the same sequences")


FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""What flash attention's CUDA kernels compute in."""


def check_flash_call(func, args) -> None:
    """The CUDA contract of a call of `aten._flash_attention_forward` / `_backward` (`func`,
    its positional `args`): `_check_operands`, and operands in fp16 or bf16, the backward's
    output gradient and output like q. The ops' meta kernels check none of it, so a trace on
    fake tensors runs this before each call (lctrain.tracing.trace)."""
    backward = func is torch.ops.aten._flash_attention_backward.default
    operands = args[:6] if backward else args[:3]
    q, k, v = operands[1:4] if backward else operands
    _check(q.dtype in FLASH_DTYPES, f"q, k, v are fp16 or bf16; got {q.dtype}")
    if backward:
        _check(operands[0].shape == q.shape == operands[4].shape
               and operands[0].dtype == q.dtype == operands[4].dtype,
               "the output and its gradient are like q")
    cu_q, cu_k, max_q, max_k = args[6:10] if backward else args[3:7]
    _check_operands(q, k, v, cu_q, cu_k, max_q, max_k)


FLASH_OPS = (torch.ops.aten._flash_attention_forward.default,
             torch.ops.aten._flash_attention_backward.default)


def _band(is_causal: bool, left: int | None, right: int | None) -> tuple[int, int] | None:
    """The window the CUDA op's arguments ask for (None: none); causal forces right = 0, as the
    CUDA op does."""
    left, right = -1 if left is None else left, -1 if right is None else right
    _check(left >= -1 and right >= -1, f"window sizes are -1 or >= 0; got ({left}, {right})")
    if is_causal:
        right = 0
    return None if (left, right) == (-1, -1) else (left, right)


def _as_varlen(x: Tensor) -> tuple[Tensor, Tensor]:
    """[B, S, ...] -> ([B * S, ...], cum_seq [B + 1]): dense calls as equal-length sequences."""
    b, s = x.shape[:2]
    return x.reshape(b * s, *x.shape[2:]), torch.arange(0, b * s + 1, s, dtype=torch.int32)


def cpu_flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                      is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                      window_size_right=None, seqused_k=None, alibi_slopes=None,
                      block_table=None, num_splits=None):
    """`aten._flash_attention_forward` on the CPU: the CUDA op's argument rules, outputs and
    layouts (lse [B, H, Sq] dense, [H, total_q] varlen; +inf for rows that see no key),
    computed by the varlen reference."""
    _check_operands(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    _check(dropout_p == 0.0 and not return_debug_mask and alibi_slopes is None
           and seqused_k is None and block_table is None, "lctrain uses no dropout, debug "
           "mask, alibi, seqused_k or paged kv")
    band = _band(is_causal, window_size_left, window_size_right)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if cum_seq_q is None:
        b, sq, h = query.shape[:3]
        (q, cu_q), (k, cu_k), (v, _) = _as_varlen(query), _as_varlen(key), _as_varlen(value)
        out, lse = varlen_forward(q, k, v, cu_q, cu_k, scale, is_causal, band)
        out, lse = out.view(query.shape), lse.view(h, b, sq).transpose(0, 1).contiguous()
    else:
        out, lse = varlen_forward(query, key, value, cum_seq_q, cum_seq_k, scale, is_causal,
                                  band)
    rng_state = torch.zeros(2, dtype=torch.uint64)
    return out, lse, rng_state, torch.empty(0, dtype=torch.uint64), torch.empty(0, dtype=query.dtype)


def cpu_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                       max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                       window_size_left=None, window_size_right=None):
    """`aten._flash_attention_backward` on the CPU: checks the merged (out, lse) it is given
    against the forward's layouts, then the varlen reference's backward."""
    dense = cum_seq_q is None
    _check_operands(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    _check(grad_out.shape == out.shape == query.shape and grad_out.stride(-1) == 1,
           f"dout {tuple(grad_out.shape)} and out {tuple(out.shape)} shaped like q")
    h, rows = query.shape[-2], query.shape[:-2]
    want = (rows[0], h, rows[1]) if dense else (h, rows[0])
    lse_dtype = _acc(query)  # float32; float64 only for the CPU's reference-grade runs
    _check(logsumexp.dtype == lse_dtype and tuple(logsumexp.shape) == want
           and logsumexp.is_contiguous(), f"lse is {lse_dtype} {want}, contiguous; got "
           f"{logsumexp.dtype} {tuple(logsumexp.shape)}")
    _check(dropout_p == 0.0 and isinstance(rng_state, Tensor), "no dropout; an rng_state tensor")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    band = _band(is_causal, window_size_left, window_size_right)
    if not dense:
        return varlen_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                               scale, is_causal, band)
    b, sq = rows
    (q, cu_q), (k, cu_k), (v, _) = _as_varlen(query), _as_varlen(key), _as_varlen(value)
    lse = logsumexp.transpose(0, 1).reshape(h, b * sq)
    dq, dk, dv = varlen_backward(_as_varlen(grad_out)[0], q, k, v, _as_varlen(out)[0], lse, cu_q,
                                 cu_k, scale, is_causal, band)
    return dq.view(query.shape), dk.view(key.shape), dv.view(value.shape)


_CPU_FLASH_LIBRARY: list = []


def register_cpu_flash_ops() -> None:
    """Give `aten._flash_attention_forward` / `_backward` a CPU implementation (the two functions
    above), so the `torch` backend's real calls, dispatched through the ops' own schemas, run
    and are checked on a machine without CUDA. Once per process (forked ranks inherit it)."""
    if _CPU_FLASH_LIBRARY:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", cpu_flash_forward, "CPU")
    lib.impl("_flash_attention_backward", cpu_flash_backward, "CPU")
    _CPU_FLASH_LIBRARY.append(lib)
