"""Local attention on blocks of tokens with known global positions, returning (out, lse).

Every context-parallel algorithm reduces to: queries at global positions q_pos attend to keys at
k_pos (causal: k_pos <= q_pos; packed documents: same document id). Positions come from
`lctrain.layout.sequence`, so a block is a set of runs of consecutive positions. Each (query
run, key run) pair is classified as empty (skipped), full (no mask), causal diagonal
(is_causal), or general (explicit mask, e.g. document borders), computed by the device kernel,
and merged into float32 accumulators with one numerically stable (out, lse) merge
(docs/parallelism.md §4). `kernel_calls` lists the calls a block pair decomposes into.

Tensors are [B, S, H, d] (H_kv heads for k and v: GQA is native in the kernels); lse is
[B, H, S] float32. A query row with no visible key has lse = -inf and output 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from lctrain.layout.sequence import Run, runs

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Block:
    """Tokens of one attention operand: global positions [S] and optional document ids [B, S]."""

    pos: Tensor
    doc: Tensor | None = None

    def runs(self) -> list[Run]:
        return runs(self.pos)


class KernelCall(NamedTuple):
    """One kernel launch of a (query block, key block) pair."""

    rows: slice
    """Batch rows it covers."""
    q: slice
    """Local query indices."""
    k: slice
    """Local key indices."""
    kind: str
    """full (no mask) | causal (is_causal diagonal) | mask (explicit boolean mask)."""
    mask: Tensor | None
    """[B or 1, 1, q, k] boolean, True where the key is visible (kind == 'mask' only)."""


def merge_into(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """In place: (out_acc, lse_acc) <- softmax-merge of itself with (out, lse).

    out [B, S, H, d], lse [B, H, S]; rows where both lse are -inf stay (0, -inf).
    """
    new = torch.logaddexp(lse_acc, lse)
    finite = torch.isfinite(new)
    w_old = torch.where(finite, torch.exp(lse_acc - new), 0.0).transpose(1, 2)[..., None]
    w_new = torch.where(finite, torch.exp(lse - new), 0.0).transpose(1, 2)[..., None]
    out_acc.mul_(w_old).add_(out.to(out_acc.dtype) * w_new)
    lse_acc.copy_(new)


def _segments(q: Block, k: Block, qr: Run, kr: Run, causal: bool, row: slice):
    """Split one key run against one query run into kernel calls.

    Causal: keys before the query run are fully visible, keys inside its position range form the
    causal diagonal, keys after it are invisible. Yields (key slice, kind, bool mask or None) with
    kind 'full' | 'causal' | 'mask'; document ids (of the batch rows `row`) add a mask where the
    documents differ.
    """
    qs = qr.rows
    cuts = [kr.start, kr.end]
    if causal:
        cuts = sorted({kr.start, kr.clamp(qr.start), kr.clamp(qr.end), kr.end})
    for lo, hi in zip(cuts, cuts[1:]):
        if causal and lo >= qr.end:  # after the last query: causal masks it out entirely
            continue
        ks = kr.local_slice(lo, hi)
        if not causal or hi <= qr.start:
            kind = "full"
        else:
            kind = "causal" if (lo, hi) == (qr.start, qr.end) else "mask"
        mask = None
        if kind == "mask":
            mask = (k.pos[ks][None, :] <= q.pos[qs][:, None])[None, None]  # [1, 1, qn, kn]
        if q.doc is not None:
            qd, kd = q.doc[row, qs], k.doc[row, ks]
            if not bool((qd.amin() == kd.amax()) & (qd.amax() == kd.amin())):
                if mask is None:
                    mask = torch.ones(qr.length, hi - lo, dtype=torch.bool, device=q.pos.device)
                    mask = (mask.tril() if kind == "causal" else mask)[None, None]
                mask = mask & (qd[:, None, :, None] == kd[:, None, None, :])
                kind = "mask"
        if mask is not None and not bool(mask.any()):
            continue
        yield ks, kind, mask


def _stretches(doc: Tensor) -> dict[int, tuple[int, int]] | None:
    """{document id: (offset, length)} of a run's tokens [n], or None when an id comes back
    after another one (then documents are not contiguous and need an explicit mask)."""
    ids, counts = torch.unique_consecutive(doc, return_counts=True)
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        return None
    starts = torch.cumsum(counts, 0) - counts
    return {d: (s, n) for d, s, n in zip(ids.tolist(), starts.tolist(), counts.tolist())}


def _document_calls(qb: Block, kb: Block, q_run: Run, k_run: Run, causal: bool):
    """Calls of one run pair with packed documents: each row's documents attend only to
    themselves, so the pair splits into same-document stretches that need no document mask
    (memory and work O(document length^2), not O(run length^2))."""
    for b in range(qb.doc.shape[0]):
        row = slice(b, b + 1)
        q_docs, k_docs = _stretches(qb.doc[b, q_run.rows]), _stretches(kb.doc[b, k_run.rows])
        if q_docs is None or k_docs is None:  # not packed: one masked pass over the pair
            for ks, kind, mask in _segments(qb, kb, q_run, k_run, causal, row):
                yield KernelCall(row, q_run.rows, ks, kind, mask)
            continue
        plain_q, plain_k = Block(qb.pos), Block(kb.pos)
        for d, (qo, ql) in q_docs.items():
            if d not in k_docs:
                continue
            q_doc, k_doc = q_run.part(qo, ql), k_run.part(*k_docs[d])
            for ks, kind, mask in _segments(plain_q, plain_k, q_doc, k_doc, causal, row):
                yield KernelCall(row, q_doc.rows, ks, kind, mask)


def kernel_calls(qb: Block, kb: Block, causal: bool) -> Iterator[KernelCall]:
    """Every kernel call of q block x kv block, in order: the decomposition the kernels run
    (public for tests and benchmarks that count work)."""
    k_runs = kb.runs()
    every = slice(None)
    for q_run in qb.runs():
        for k_run in k_runs:
            if qb.doc is not None:
                yield from _document_calls(qb, kb, q_run, k_run, causal)
                continue
            for ks, kind, mask in _segments(qb, kb, q_run, k_run, causal, every):
                yield KernelCall(every, q_run.rows, ks, kind, mask)


def _cpu_fwd(q, k, v, kind, mask, scale):
    additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype,
                                                     device=q.device).masked_fill(~mask, _NEG_INF)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, kind == "causal", attn_mask=additive, scale=scale)
    if mask is not None:  # the CPU kernel reports lse = 0 for rows with no visible key
        empty = ~mask.any(-1).expand(lse.shape)
        lse = lse.masked_fill(empty, _NEG_INF)
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def _cpu_bwd(dout, q, k, v, out, lse, kind, mask, scale):
    additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype,
                                                     device=q.device).masked_fill(~mask, _NEG_INF)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)  # rows with no key anywhere: P = 0
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, kind == "causal", attn_mask=additive, scale=scale)


def _flash_attn():
    try:
        import flash_attn  # noqa: F401  (optional `gpu` extra)
        from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    except ImportError as e:
        raise RuntimeError("context-parallel attention on CUDA needs flash-attn: "
                           "pip install 'lctrain[gpu]'") from e
    return _flash_attn_forward, _flash_attn_backward


def _cuda_fwd(q, k, v, kind, mask, scale):
    if mask is not None:
        raise NotImplementedError("document masks inside a block need flash-attn varlen, which "
                                  "lctrain does not call yet; train without document masking on "
                                  "GPU")
    fwd, _ = _flash_attn()
    # flash-attn wants [B, S, H, d]
    out, lse, *_ = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, scale,
                       causal=kind == "causal", window_size_left=-1, window_size_right=-1,
                       softcap=0.0, alibi_slopes=None, return_softmax=False)
    return out.transpose(1, 2), lse.to(acc_dtype(q))


def _cuda_bwd(dout, q, k, v, out, lse, kind, mask, scale):
    _, bwd = _flash_attn()
    t = [x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out)]
    dq, dk, dv = (torch.empty_like(x) for x in t[1:4])
    bwd(*t, lse.contiguous(), dq, dk, dv, 0.0, scale, kind == "causal", -1, -1, 0.0, None, False)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _kernels(device: torch.device):
    return (_cuda_fwd, _cuda_bwd) if device.type == "cuda" else (_cpu_fwd, _cpu_bwd)


def attend_forward(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block, causal: bool,
                   scale: float, out_acc: Tensor, lse_acc: Tensor) -> int:
    """Attend q (positions qb) to k, v (positions kb); merge into the accumulators.

    q [B, Sq, H, d], k/v [B, Sk, Hkv, d], out_acc [B, Sq, H, d] f32, lse_acc [B, H, Sq] f32.
    Returns the number of kernel calls (0 when every pair was masked out).
    """
    fwd, _ = _kernels(q.device)
    calls = 0
    for bs, qs, ks, kind, mask in kernel_calls(qb, kb, causal):
        out, lse = fwd(q[bs, qs].transpose(1, 2), k[bs, ks].transpose(1, 2),
                       v[bs, ks].transpose(1, 2), kind, mask, scale)
        merge_into(out_acc[bs, qs], lse_acc[bs, :, qs], out.transpose(1, 2), lse)
        calls += 1
    return calls


def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    qb: Block, kb: Block, causal: bool, scale: float, dq_acc: Tensor,
                    dk_acc: Tensor, dv_acc: Tensor) -> None:
    """Gradient contributions of this (q, kv) block, given the FINAL out and lse of q's rows.

    With the merged lse, each block's softmax probabilities are exact, so per-block backward
    results simply add up (flash-attention backward decomposition). Accumulators are float32.
    """
    _, bwd = _kernels(q.device)
    for bs, qs, ks, kind, mask in kernel_calls(qb, kb, causal):
        dq, dk, dv = bwd(*(x[bs, qs].transpose(1, 2) for x in (dout, q)),
                         k[bs, ks].transpose(1, 2), v[bs, ks].transpose(1, 2),
                         out[bs, qs].transpose(1, 2), lse[bs, :, qs], kind, mask, scale)
        dq_acc[bs, qs] += dq.transpose(1, 2)
        dk_acc[bs, ks] += dk.transpose(1, 2)
        dv_acc[bs, ks] += dv.transpose(1, 2)


def acc_dtype(x: Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (reference-grade runs)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def new_accumulators(q: Tensor) -> tuple[Tensor, Tensor]:
    """Empty (out, lse) accumulators for q [B, S, H, d]: zeros and -inf (see acc_dtype)."""
    b, s, h, d = q.shape
    return (torch.zeros(b, s, h, d, dtype=acc_dtype(q), device=q.device),
            torch.full((b, h, s), _NEG_INF, dtype=acc_dtype(q), device=q.device))


def reference_attention(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block, causal: bool,
                        scale: float) -> tuple[Tensor, Tensor]:
    """Plain-torch attention with an explicit mask (tests only; differentiable; any dtype).

    Rows with no visible key give out 0 and lse -inf.
    """
    rep = q.shape[2] // k.shape[2]
    kf, vf = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kf) * scale
    mask = (kb.pos[None, :] <= qb.pos[:, None])[None, None]
    if not causal:
        mask = torch.ones_like(mask)
    if qb.doc is not None:
        mask = mask & (qb.doc[:, None, :, None] == kb.doc[:, None, None, :])
    visible = mask.any(-1, keepdim=True)  # rows with at least one key
    scores = scores.masked_fill(~mask, _NEG_INF).masked_fill(~visible, 0.0)  # finite lse, no NaN
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]) * mask
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out, lse.masked_fill(~visible[..., 0], _NEG_INF)
