"""The independent reference the attention tests and tools/gpu_check.py compare against: plain
torch attention over the whole sequence with an explicit mask (causal, and documents), no
blocks, no online softmax, no merge."""

from __future__ import annotations

import torch
from torch import Tensor

from lctrain.attention.calls import Block

_NEG_INF = float("-inf")


def reference_attention(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block, causal: bool,
                        scale: float, window: int | None = None,
                        sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Plain-torch attention with an explicit mask (differentiable; any dtype). `window`: each
    query sees only keys at most window - 1 positions before it (transformers' sliding window:
    key > query - window). `sink` [H]: one more score per head in every row's softmax, with no
    value (GPT-OSS's attention sinks, as transformers' eager attention concatenates them).

    Rows with no visible key give out 0 and lse -inf (with sinks: lse = the sink).
    """
    rep = q.shape[2] // k.shape[2]
    kf, vf = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kf) * scale
    mask = (kb.pos[None, :] <= qb.pos[:, None])[None, None]
    if not causal:
        mask = torch.ones_like(mask)
    if window is not None:
        mask = mask & (kb.pos[None, :] > qb.pos[:, None] - window)[None, None]
    if qb.doc is not None:
        mask = mask & (qb.doc[:, None, :, None] == kb.doc[:, None, None, :])
    mask = mask.to(q.device)
    if sink is not None:  # a column every query sees, whose value is zero
        b, h, n, _ = scores.shape
        scores = torch.cat([scores, sink.to(scores.dtype)[None, :, None, None].expand(
            b, h, n, 1)], dim=-1)
        mask = torch.cat([mask.expand(b, h, n, -1), torch.ones(b, h, n, 1, dtype=torch.bool,
                                                               device=mask.device)], dim=-1)
        vf = torch.cat([vf, torch.zeros_like(vf[:, :1])], dim=1)
    visible = mask.any(-1, keepdim=True)  # rows with at least one key
    scores = scores.masked_fill(~mask, _NEG_INF).masked_fill(~visible, 0.0)  # finite lse, no NaN
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]) * mask
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out, lse.masked_fill(~visible[..., 0], _NEG_INF)
