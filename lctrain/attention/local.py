"""Attention of local queries to one local set of keys (no communication), with autograd.

Used directly when cp = 1 with packed documents, after the Ulysses all-to-all, and after the
all-gather of K/V. Positions and documents decide which kernel calls run (calls.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lctrain.attention.calls import Block
from lctrain.attention.kernels import (
    DEFAULT_KERNEL,
    KernelOptions,
    acc_dtype,
    add_sink,
    attend_backward,
    attend_forward,
    attend_whole,
    attend_whole_backward,
    new_accumulators,
    sink_grad,
)


def block_forward(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block, causal: bool,
                  scale: float, options: KernelOptions,
                  window: int | None = None) -> tuple[Tensor, Tensor]:
    """(out [B, Sq, H, d], lse f32 [B, H, Sq]) of q attending to one kv block; out in float32,
    or in q's dtype when one kernel call produced it whole."""
    whole = attend_whole(q, k, v, qb, kb, causal, scale, options, window)
    if whole is not None:
        return whole
    out, lse = new_accumulators(q)
    attend_forward(q, k, v, qb, kb, causal, scale, out, lse, options, window)
    return out, lse


def block_backward(dout, q, k, v, out, lse, qb: Block, kb: Block, causal: bool, scale: float,
                   options: KernelOptions, window: int | None = None, keep_acc: bool = False):
    """(dq, dk, dv) in the inputs' dtypes; with keep_acc, in the float32 accumulators (when more
    than one kernel call contributes) for a caller that sums them further across ranks."""
    whole = attend_whole_backward(dout, q, k, v, out, lse, qb, kb, causal, scale, options, window)
    if whole is not None:
        return whole
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc_dtype(x), device=x.device) for x in (q, k, v))
    attend_backward(dout, q, k, v, out, lse, qb, kb, causal, scale, dq, dk, dv, options, window)
    if keep_acc:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def save_final(ctx, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """An autograd Function's last forward step: the merged (out, lse) with the sinks added
    (`add_sink`), out in q's dtype, saved with q, k, v for the backward (the sinks on ctx.sink:
    their gradient is `sink_grad` of the saved out and lse)."""
    out, lse = add_sink(out, lse, sink)
    out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.sink = sink
    ctx.mark_non_differentiable(lse)
    return out, lse


def forward_and_save(ctx, q, k, v, qb: Block, kb: Block, causal: bool, scale: float,
                     options: KernelOptions, window: int | None = None,
                     sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """An autograd Function's forward of q attending to k, v: (out in q's dtype, lse), with
    what `block_backward` needs saved on ctx (tensors) and ctx.args (the rest)."""
    out, lse = block_forward(q, k, v, qb, kb, causal, scale, options, window)
    ctx.args = (qb, kb, causal, scale, options, window)
    return save_final(ctx, q, k, v, out, lse, sink)


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, qb, kb, causal, scale, options, window):
        return forward_and_save(ctx, q, k, v, qb, kb, causal, scale, options, window, sink)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, sink_grad(dout, out, lse, ctx.sink), None, None, None, None, None, None


def local_attention(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block, *, causal: bool,
                    scale: float, options: KernelOptions = DEFAULT_KERNEL,
                    window: int | None = None,
                    sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [B, Sq, H, d] at positions qb, k/v [B, Sk, H_kv, d] at kb -> (out [B, Sq, H, d], lse).
    `window`: a sliding window of that many keys (None: the whole causal context); `sink`:
    attention sinks, a logit per query head [H] (None: none)."""
    return _LocalAttention.apply(q, k, v, sink, qb, kb, causal, scale, options, window)
