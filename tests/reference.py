"""The independent reference the attention tests and tools/gpu_check.py compare against: plain
torch attention over the whole sequence with an explicit mask (causal, and documents), no
blocks, no online softmax, no merge; and which keys a window layer's queries see, key by key
(`window_needed`: what lctrain finds from segments, `lctrain.layout.halo.needed`, is tested
against it)."""

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


def window_needed(key_pos: Tensor, key_doc: Tensor | None, query_pos: Tensor,
                  query_doc: Tensor | None, window: int) -> Tensor:
    """[R, Sk] bool: which keys some query sees through a causal window of `window` keys.
    Positions [S] or [B, S]; documents [B, S] or None (then R = 1 row of shared positions)."""
    kp, kd = _rows(key_pos, key_doc)
    qp, qd = _rows(query_pos, query_doc)
    low = min(int(kd.min()), int(qd.min()))
    span = int(max(kp.max(), qp.max())) + window + 1
    queries = window_keys(query_pos, query_doc, low, span).sort(dim=1).values
    return needed_by(queries, window_keys(key_pos, key_doc, low, span), window)


def window_keys(pos: Tensor, doc: Tensor | None, low: int, span: int) -> Tensor:
    """[R, S] (document, position) as one sortable integer, (doc - low) x span + position: two
    tokens' keys differ by less than `span` only within one document, for documents from `low`
    on and positions below span - window."""
    p, d = _rows(pos, doc)
    return (d - low) * span + p


def needed_by(sorted_query_keys: Tensor, token_keys: Tensor, window: int) -> Tensor:
    """[R, Sk] bool: the tokens (`window_keys`) some query (its keys sorted per row) sees
    through a causal window of `window` keys: the first query at or after a token is at most
    window - 1 positions after it, in its document."""
    at = torch.searchsorted(sorted_query_keys, token_keys)
    first = sorted_query_keys.gather(1, at.clamp(max=sorted_query_keys.shape[1] - 1))
    return (at < sorted_query_keys.shape[1]) & (first < token_keys + window)


def _rows(pos: Tensor, doc: Tensor | None) -> tuple[Tensor, Tensor]:
    """(positions, documents) [R, S]: R = B with documents, one shared row without."""
    if doc is None:
        return pos.reshape(1, -1), torch.zeros(1, pos.shape[-1], dtype=torch.long)
    return pos.expand_as(doc), doc


def gated_delta_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          doc_ids: Tensor | None = None, initial_state: Tensor | None = None
                          ) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token, in the inputs' dtype: per value head the state
    S [d_k, d_v] decays by exp(g_t), takes beta_t (v_t - S^T k_t) along k_t, and o_t = S^T q_t,
    with q and k L2-normalised and q scaled by d_k^-1/2; a document's first token starts from
    zero (the row's first token from `initial_state`). Shapes as
    `lctrain.attention.delta_rule.chunk_gated_delta_rule`."""
    b, s, h_k, d_k = k.shape
    h = v.shape[2]
    q, k = (x.repeat_interleave(h // h_k, dim=2) for x in (q, k))
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * d_k ** -0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    rows, states = [], []
    for r in range(b):
        state = (torch.zeros(h, d_k, v.shape[-1], dtype=v.dtype) if initial_state is None
                 else initial_state[r])
        out = []
        for t in range(s):
            if t > 0 and doc_ids is not None and doc_ids[r, t] != doc_ids[r, t - 1]:
                state = torch.zeros_like(state)
            state = state * g[r, t].exp()[:, None, None]
            delta = (v[r, t] - torch.einsum("hkv,hk->hv", state, k[r, t])) * beta[r, t][:, None]
            state = state + torch.einsum("hk,hv->hkv", k[r, t], delta)
            out.append(torch.einsum("hkv,hk->hv", state, q[r, t]))
        rows.append(torch.stack(out))
        states.append(state)
    return torch.stack(rows), torch.stack(states)
