"""The generic single-device decoder every registered family builds (`Decoder`): embedding,
blocks composed per layer (`lctrain.models.blocks`: a token mixer and a feed-forward from their
registries, the family's parts), final norm, output layer. Plain model code: tensor parallelism,
activation checkpointing and data parallelism are applied to it from outside
(`lctrain.parallel.parallelize`), and the untouched model is every test's reference.

Parameter names follow torchtitan (`tok_embeddings`, `layers.{i}.attention.wq`, ...); layers live
in a ModuleDict keyed by their global id so that a pipeline split deletes modules without
renaming checkpoint keys. `forward` tolerates a missing embedding (input is then a hidden state)
and a missing output layer (the hidden state is returned). RoPE uses the "rotate half" layout of
Hugging Face Llama, so HF weights map one to one (see `lctrain.models.hf`). Every module says
how its parameters start (`init_rules`); the values come from lctrain.models.init, the same for
every layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lctrain.config import ModelConfig
from lctrain.config.model_families import model_family
from lctrain.config.model_parts import EMBED_SCALE, NORM_OFFSET
from lctrain.data.batch import IGNORE_INDEX
from lctrain.models.blocks import Block, BlockParts
from lctrain.models.init import init_weights
from lctrain.models.moe import RouterLog
from lctrain.models.norms import RMSNorm
from lctrain.models.rope import RotaryEmbedding

LossHead = Callable[[nn.Module, Tensor, Tensor], Tensor]
"""(output layer, final hidden state [B, S, D], labels [B, S]) -> sum of token losses."""


def cross_entropy_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of the cross-entropies of the valid targets (labels != IGNORE_INDEX), in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def full_logits_loss(output: nn.Module, h: Tensor, labels: Tensor) -> Tensor:
    """The loss head that computes every logit at once."""
    return cross_entropy_sum(output(h), labels)


def without_routing(out: Tensor | tuple[Tensor, Tensor]) -> Tensor:
    """A model's output without the routing table a model with experts returns beside it."""
    return out[0] if isinstance(out, tuple) else out


class Decoder(nn.Module):
    """The decoder: embedding, blocks, final norm, output layer. `build` holds the attention
    core, the code of the family's parts and its experts' class
    (`lctrain.models.registry.new_model` fills it from the family)."""

    def __init__(self, cfg: ModelConfig, build: BlockParts):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        family = model_family(cfg.family)
        self.rope = RotaryEmbedding(cfg)
        self.rope_local = (None if cfg.rope_local_theta is None else RotaryEmbedding(
            dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_type="default")))
        """The sliding layers' RoPE, when it differs (model.rope_local_theta: Gemma 3)."""
        self.local_rope_layers = {str(i) for i in range(cfg.n_layers)
                                  if self.rope_local is not None and cfg.layer_window(i)}
        self.embed_scale = math.sqrt(cfg.dim) if family.has(EMBED_SCALE) else None
        self.router_log = RouterLog()
        """The MoE layers' routing of the current forward (lctrain.models.moe)."""
        build = dataclasses.replace(build, router_log=self.router_log)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, build) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps, family.has(NORM_OFFSET))
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.loss_head: LossHead = full_logits_loss
        """How the loss is computed from the final hidden state (the sequence-tiled head of
        lctrain.parallel.tiling plugs in here)."""

    def forward(self, x: Tensor, routing: Tensor | None = None, *,
                positions: Tensor | None = None, doc_ids: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """tokens [B, S] (or hidden [B, S, D] without an embedding) -> logits [B, S, V], or with
        `labels` [B, S] the sum of the token cross-entropies (IGNORE_INDEX targets left out),
        with `labels` [G, B, S] the G sums of G label sets over the one forward (the
        validation loss by position band); the hidden state without an output layer.

        A model with experts returns (that output, its routing table): the forward's routing
        (`lctrain.models.moe.RouterLog.table`) plus `routing`, the table of the pipeline stages
        before it. The load-balancing loss is the caller's (`lctrain.models.moe.table_loss`,
        once the tables of every rank holding the micro-batch's tokens are summed).

        positions: RoPE position ids [B or 1, S] (default 0..S-1); with context parallelism the
        global positions of this rank's tokens. doc_ids: see `lctrain.models.blocks`.
        """
        if routing is not None and not self.cfg.n_experts:
            raise TypeError("a routing table for a model without experts (positions, doc_ids "
                            "and labels are keyword arguments)")
        if positions is None:  # from the input: with sequence parallelism h holds S/tp tokens
            positions = torch.arange(x.shape[1], device=x.device)[None]
        h = x
        self.router_log.clear()
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.embed_scale is not None:  # in the embedding's dtype, as HF Gemma rounds it
                h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        dtype = (h.dtype if not torch.is_autocast_enabled(h.device.type)
                 else torch.get_autocast_dtype(h.device.type))
        cos, sin = self.rope(positions, dtype)
        local = self.rope_local(positions, dtype) if self.local_rope_layers else (cos, sin)
        for name, layer in self.layers.items():
            c, s = local if name in self.local_rope_layers else (cos, sin)
            h = layer(h, cos=c, sin=s, doc_ids=doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        out = self._output(h, labels)
        if not self.cfg.n_experts:
            return out
        table = self.router_log.table(self.cfg.moe_layer_ids, self.cfg.n_experts, h.device)
        return out, table if routing is None else routing + table

    def _output(self, h: Tensor, labels: Tensor | None) -> Tensor:
        if self.output is None:
            return h
        if labels is None:
            return self.output(h)
        if labels.dim() == 3:  # several label sets over one forward: one loss sum each
            return torch.stack([self.loss_head(self.output, h, group) for group in labels])
        return self.loss_head(self.output, h, labels)

    def init_rules(self) -> dict[str, float | None]:
        rules = {}
        if self.tok_embeddings is not None:
            rules["tok_embeddings.weight"] = self.cfg.init_std
        if self.output is not None:  # tied: the embedding's rule, already drawn
            rules["output.weight"] = self.cfg.init_std
        return rules

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`, the same global weights for every layout (each
        parameter has its own random streams: lctrain.models.init): normal(init_std) for the
        embedding, the output layer and the input projections, init_std / sqrt(2 n_layers) for
        the projections that feed the residual stream, ones for the norms, zeros for
        biases."""
        init_weights(self, seed)
