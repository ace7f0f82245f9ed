"""What each part of `lctrain.config.model_parts` does in the model code, one class per part
that adds modules or acts in the forward: what it builds into a block's attention or into the
block, where it acts (the seams `Part.qkv` and `Part.mixer_out`/`Part.ffn_out`, called for each
of the family's parts in order), its Hugging Face names and its TP plan entries.

The other parts configure a module that every family has, where that module is built: the
biases (`qkv_bias`, `out_bias`) the attention's projections, `norm_offset` every RMSNorm,
`gelu_tanh` the gated MLP's activation, `embed_scale` the embedding, `windows` each layer's
window, `experts`, `router_bias` and `expert_bias` the mixture of experts (the experts' class
is the family's: `FamilyCode.experts`). They are registered here without code (`Part`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import SequenceParallel

from lctrain.config import ModelConfig
from lctrain.config.model_families import ModelFamily, model_family
from lctrain.config.model_parts import (
    MODEL_PARTS,
    NORM_OFFSET,
    OUTPUT_GATE,
    QK_NORM,
    SANDWICH_NORMS,
    SHARED_EXPERT,
    SINKS,
)
from lctrain.config.registry import Registry
from lctrain.models.norms import RMSNorm

HEADS_DIM = 2
"""The heads dimension of q and k [B, S, H, d]: what TP shards."""


class Part:
    """A part's code. The defaults add nothing and return their input: a part overrides the
    seams where it acts."""

    hf_names: dict[str, str] = {}
    """lctrain module path inside a block -> Hugging Face path, for the modules it adds (or
    renames)."""
    hf_params: dict[str, str] = {}
    """Parameters it adds that are not a module's weight or bias: lctrain path inside a block ->
    Hugging Face name inside `model.layers.{i}`."""
    block_norms: tuple[str, ...] = ()
    """Norms it adds to the block on a sublayer's output (sequence parallelism shards them)."""

    def __init__(self, name: str):
        self.name = name

    def tp_plan(self) -> dict[str, Any]:
        """Tensor-parallel styles of the modules it adds (biases need none: they shard with
        their columns)."""
        return {}

    def build_attention(self, attention: nn.Module, cfg: ModelConfig) -> None:
        """Add its modules and parameters to a block's attention."""

    def build_block(self, block: nn.Module, cfg: ModelConfig) -> None:
        """Add its modules to a block."""

    def query(self, attention: nn.Module, q: Tensor) -> tuple[Tensor, Tensor | None]:
        """The query projection's output as heads [B, S, H', d] -> (queries [B, S, H, d], a
        gate [B, S, H, d] on the attention's output, or None)."""
        return q, None

    def qkv(self, attention: nn.Module, q: Tensor, k: Tensor, v: Tensor
            ) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, S, H, d], k and v [B, S, H_kv, d] (this rank's heads under TP), before RoPE."""
        return q, k, v

    def mixer_out(self, block: nn.Module, out: Tensor) -> Tensor:
        """The token mixer's output [B, S, D], before the residual add."""
        return out

    def ffn_out(self, block: nn.Module, out: Tensor) -> Tensor:
        """The feed-forward's output [B, S, D], before the residual add."""
        return out


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.norm_eps, model_family(cfg.family).has(NORM_OFFSET))


class HeadNorms(Part):
    """An RMSNorm over each query and key head before RoPE (`q_norm`, `k_norm`, a weight of
    head_dim each: Qwen3, Gemma 3). Under tensor parallelism they are replicated and each rank
    normalises its own heads; their weights' gradients are summed over the TP ranks by
    treating the heads dimension as the sharded one (torch's SequenceParallel style on dim 2),
    as the block norms are under SP."""

    hf_names = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}

    def tp_plan(self) -> dict[str, Any]:
        return {name: SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)
                for name in ("attention.q_norm", "attention.k_norm")}

    def build_attention(self, attention: nn.Module, cfg: ModelConfig) -> None:
        attention.q_norm = _norm(cfg, cfg.d_head)
        attention.k_norm = _norm(cfg, cfg.d_head)

    def qkv(self, attention: nn.Module, q: Tensor, k: Tensor, v: Tensor
            ) -> tuple[Tensor, Tensor, Tensor]:
        return attention.q_norm(q), attention.k_norm(k), v


class SandwichNorms(Part):
    """An RMSNorm on the attention's output and one on the MLP's, before each residual add
    (Gemma). Hugging Face calls the first `post_attention_layernorm`, the name Llama gives the
    norm before the MLP, which is therefore `pre_feedforward_layernorm` here."""

    hf_names = {"ffn_norm": "pre_feedforward_layernorm",
                "attention_out_norm": "post_attention_layernorm",
                "ffn_out_norm": "post_feedforward_layernorm"}
    block_norms = ("attention_out_norm", "ffn_out_norm")

    def build_block(self, block: nn.Module, cfg: ModelConfig) -> None:
        block.attention_out_norm = _norm(cfg, cfg.dim)
        block.ffn_out_norm = _norm(cfg, cfg.dim)

    def mixer_out(self, block: nn.Module, out: Tensor) -> Tensor:
        return block.attention_out_norm(out)

    def ffn_out(self, block: nn.Module, out: Tensor) -> Tensor:
        return block.ffn_out_norm(out)


class Sinks(Part):
    """A learnable sink logit per query head (GPT-OSS; docs/parallelism.md §26), in the
    attention's `sinks`, which passes it to the core (under TP sharded by heads like the
    queries: `lctrain.parallel.tensor`)."""

    hf_params = {"attention.sinks": "self_attn.sinks"}

    def build_attention(self, attention: nn.Module, cfg: ModelConfig) -> None:
        attention.sinks = nn.Parameter(torch.empty(cfg.n_heads))


class OutputGate(Part):
    """The attention's output times sigmoid of a gate per query dimension (Qwen3.5, Qwen3-Next),
    before the output projection. The query projection makes both, each head's d queries then
    its d gates (Hugging Face's `q_proj` of 2 H d rows), so TP's column split keeps a head's
    pairs together."""

    def build_attention(self, attention: nn.Module, cfg: ModelConfig) -> None:
        attention.wq = nn.Linear(cfg.dim, 2 * cfg.q_dim, bias=attention.wq.bias is not None)

    def query(self, attention: nn.Module, q: Tensor) -> tuple[Tensor, Tensor | None]:
        b, s, pairs, d = q.shape
        q, gate = q.view(b, s, pairs // 2, 2, d).unbind(dim=3)
        return q, gate


class SharedExpert(Part):
    """Hugging Face's names of a mixture of experts' shared expert and its gate (Qwen3.5-MoE,
    Qwen3-Next), which `lctrain.models.blocks.mixture_of_experts` builds into the MoE
    (`lctrain.models.moe.MoE`)."""

    hf_names = {"feed_forward.shared_expert.w1": "mlp.shared_expert.gate_proj",
                "feed_forward.shared_expert.w3": "mlp.shared_expert.up_proj",
                "feed_forward.shared_expert.w2": "mlp.shared_expert.down_proj",
                "feed_forward.shared_expert_gate": "mlp.shared_expert_gate"}


_CODE = {QK_NORM.name: HeadNorms, SANDWICH_NORMS.name: SandwichNorms, SINKS.name: Sinks,
         OUTPUT_GATE.name: OutputGate, SHARED_EXPERT.name: SharedExpert}
PARTS: Registry[Part] = Registry("model part's code")
for _name in MODEL_PARTS:  # `Part`: a part that configures a module every family has
    PARTS.add(_CODE.get(_name, Part)(_name))


def parts_of(family: ModelFamily) -> tuple[Part, ...]:
    """The code of the family's parts, in its order."""
    return tuple(PARTS[part.name] for part in family.parts)
