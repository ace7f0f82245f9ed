"""Greedy generation on the training layout (docs/parallelism.md §32), context parallelism
included: the prompt is prefilled across the cp group by the run's own attention algorithm and
split, each rank keeps the keys and values of its own tokens (a sharded cache), and every new
token's query attends to every rank's shard: each rank attends over its own (float32, with
the log-sum-exp), one all-gather of the (output, lse) pairs per layer and token merges them,
and attention sinks enter once, after the merge. Windows mask the cached keys by position as the prefill did. Every cp rank
runs every decode step on the same tokens (the new token's key and value go into one rank's
shard, the ranks taking turns), so expert parallelism's collectives see every rank too.

Prompts are placed at the start of a train.seq_len window (the prefill is a training forward:
padding after the prompt changes nothing under causal attention), and the padding's cached keys
never count. Not yet: tensor parallelism with sequence parallelism (one new token cannot be
split over the TP ranks), pipeline stages and linear-attention layers (their recurrent state
is not cached): refused by name (`generation_problems`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lctrain.config import LctrainConfig
from lctrain.config.derived import load_balance_of, ulysses_degree
from lctrain.config.eval_rules import generation_problems
from lctrain.data.batch import micro_batch_from_tokens
from lctrain.models.decoder import without_routing
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.runtime import Runtime

_NEG_INF = float("-inf")


def vocab_argmax(logits: torch.Tensor, tp_group, tp_rank: int) -> torch.Tensor:
    """argmax over the vocabulary [B, S, V] -> [B, S]; a vocab-sharded DTensor is reduced with
    one all-gather of each TP rank's (max, index), never gathering the logits."""
    if not isinstance(logits, DTensor):
        return logits.argmax(-1)
    local = logits.to_local().float()
    best, idx = local.max(-1)
    idx = idx + tp_rank * local.shape[-1]
    pair = torch.stack([best, idx.float()])  # ids < 2^24 stay exact in float32
    gathered = [torch.empty_like(pair) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(gathered, pair, group=tp_group)
    stacked = torch.stack(gathered)  # [tp, 2, B, S]; the first max wins, as in a global argmax
    winner = stacked[:, 0].argmax(0, keepdim=True)
    return stacked[:, 1].gather(0, winner)[0].long()


@dataclass
class LayerCache:
    """One attention layer's cache on this rank: its tokens' keys and values [B, L, H_kv, d],
    their global positions [B or 1, L] and whether each counts (not padding)."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    positions: list[Tensor] = field(default_factory=list)
    valid: list[Tensor] = field(default_factory=list)

    def add(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        self.keys.append(k)
        self.values.append(v)
        self.positions.append(positions)
        self.valid.append(valid)

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        rows = self.keys[0].shape[0]
        expand = [p.expand(rows, -1) for p in self.positions]
        valid = [m.expand(rows, -1) for m in self.valid]
        return (torch.cat(self.keys, 1), torch.cat(self.values, 1), torch.cat(expand, 1),
                torch.cat(valid, 1))


class CachedCore:
    """An attention layer's core while generating: in the prefill the run's core, its key and
    value inputs (this rank's tokens) kept; in a decode step the new query against every rank's
    cache (`attend_cache`), the new key and value kept by the rank whose turn it is."""

    def __init__(self, base, state: _Decoding):
        self.base, self.state, self.cache = base, state, LayerCache()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None, *,
                 window: int | None = None, sink: Tensor | None = None) -> Tensor:
        s = self.state
        if s.prefill:
            self.cache.add(k, v, s.positions, s.positions < s.prompt_len)
            extra = {} if sink is None else {"sink": sink}
            return self.base(q, k, v, doc_ids, window=window, **extra)
        here = torch.full((1, 1), s.position, dtype=torch.long, device=k.device)
        mine = torch.full((1, 1), s.turn == s.cp_rank, device=k.device)
        self.cache.add(k, v, here, mine)
        return attend_cache(q, *self.cache.tensors(), s.position, window, sink, s.group)


def attend_cache(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, valid: Tensor,
                 position: int, window: int | None, sink: Tensor | None,
                 group: dist.ProcessGroup | None) -> Tensor:
    """One new query q [B, 1, H, d] at `position` against the cached keys and values [B, L,
    H_kv, d] of every rank of `group` (this rank's given; their positions and validity [B, L]):
    each rank's softmax part in float32 with its log-sum-exp, merged over the group; a sink logit
    per head [H] added once. -> [B, 1, H, d] in q's dtype."""
    rep = q.shape[2] // keys.shape[2]
    k = keys.float().repeat_interleave(rep, dim=2)
    v = values.float().repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * q.shape[-1] ** -0.5
    seen = valid if window is None else valid & (position - positions < window)
    scores = scores.masked_fill(~seen[:, None, None, :], _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, 1]
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    if group is not None and dist.get_world_size(group) > 1:
        outs = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
        lses = [torch.empty_like(lse) for _ in range(dist.get_world_size(group))]
        dist.all_gather(outs, out.contiguous(), group=group)
        dist.all_gather(lses, lse.contiguous(), group=group)
        stacked = torch.stack(lses)  # [P, B, H, 1]
        lse = torch.logsumexp(stacked, dim=0)
        share = torch.exp(stacked - lse).nan_to_num(0.0).permute(0, 1, 3, 2)[..., None]
        out = (torch.stack(outs) * share).sum(dim=0)  # shares [P, B, 1, H, 1]
    if sink is not None:
        with_sink = torch.logaddexp(lse, sink.float()[None, :, None])
        out = out * torch.exp(lse - with_sink).permute(0, 2, 1)[..., None]
    return out.to(q.dtype)


@dataclass
class _Decoding:
    """What the cached cores share during one generation."""

    prompt_len: int
    positions: Tensor
    group: dist.ProcessGroup | None
    cp: int
    cp_rank: int
    prefill: bool = True
    position: int = 0
    turn: int = 0


@contextlib.contextmanager
def _cached_cores(model: nn.Module, state: _Decoding):
    """Every attention layer's core swapped for a `CachedCore` during the generation."""
    swapped = []
    for layer in model.layers.values():
        if layer.mixer_name == "attention":
            swapped.append((layer.attention, layer.attention.core))
            layer.attention.core = CachedCore(layer.attention.core, state)
    try:
        yield
    finally:
        for attention, core in swapped:
            attention.core = core


@torch.no_grad()
def generate(model: nn.Module, cfg: LctrainConfig, rt: Runtime, prompts: Tensor,
             max_new_tokens: int, stop_token: int | None = None) -> Tensor:
    """Greedy continuations [B, max_new_tokens] of `prompts` [B, P] (P <= train.seq_len, the same
    on every rank), on this rank's layout; tokens after `stop_token` are `stop_token` again.
    Call on every rank of the model's groups."""
    problems = generation_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))
    inner = unwrap(model)
    rows, length = prompts.shape
    seq_len, p = cfg.train.seq_len, cfg.parallel
    if length > seq_len:
        raise ValueError(f"a prompt of {length} tokens is longer than train.seq_len={seq_len}; "
                         "generation prefills it in one training window")
    window = torch.zeros(rows, seq_len + 1, dtype=torch.long)
    window[:, :length] = prompts.cpu()
    cp_rank = rt.axis_rank("cp")
    documents = [np.array([length, seq_len + 1 - length])] * rows  # the prompt, the padding
    mb = micro_batch_from_tokens(window, seq_len, cp_rank, p.cp, load_balance_of(cfg),
                                 documents, cfg.data.document_masking,
                                 ulysses_degree(p)).to(rt.device)
    group = rt.group("cp") if p.cp > 1 else None
    at = mb.global_positions.to(rt.device)  # each local token's index in its row
    state = _Decoding(length, at, group, p.cp, cp_rank)
    tp_group = rt.group("tp") if p.tp > 1 else None
    tp_rank = rt.axis_rank("tp")
    with _cached_cores(inner, state), rt.autocast():
        logits = without_routing(model(mb.inputs, positions=mb.positions, doc_ids=mb.doc_ids))
        last = (at == length - 1).expand(rows, -1)  # on the rank that holds it
        picked = vocab_argmax(logits, tp_group, tp_rank)  # [B, S_local]
        token = (picked * last).sum(dim=1)
        if group is not None:
            dist.all_reduce(token, group=group)
        out = [token]
        state.prefill = False
        for step in range(max_new_tokens - 1):
            state.position, state.turn = length + step, step % p.cp
            here = torch.full((1, 1), length + step, dtype=torch.long, device=rt.device)
            logits = without_routing(model(token[:, None], positions=here))
            token = vocab_argmax(logits, tp_group, tp_rank)[:, 0]
            out.append(token)
    tokens = torch.stack(out, dim=1)
    if stop_token is not None:  # everything after the first stop token is the stop token
        stopped = (tokens == stop_token).cumsum(dim=1) > 0
        tokens = tokens.masked_fill(stopped, stop_token)
    return tokens.cpu()
