"""The model families, as every layer but the model code sees them: one registry entry per family
holding its name (config.json's `model_type`, the value of `model.family`), its transformers
classes, the parts its blocks have beyond a Llama block (`lctrain.config.model_parts`) and the
module of its code, so that validation, the parameter and FLOP counts, the memory formulas and
the planner ask the entry instead of comparing names.

The code of a family (its Hugging Face names, its config.json rules, its experts) is the module
under lctrain/models/ the entry names (`ModelFamily.module`: `lctrain.models.registry` imports
it); docs/extending.md is the checklist for adding one. This module imports nothing from
lctrain but the config registries: it sits in the config layer, so that the schema reads its
names (`one_of(registry=MODEL_FAMILIES)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lctrain.config.model_parts import (
    EMBED_SCALE,
    EXPERT_BIAS,
    EXPERTS,
    GELU_TANH,
    LINEAR_ATTENTION,
    NORM_OFFSET,
    OUT_BIAS,
    OUTPUT_GATE,
    QK_NORM,
    QKV_BIAS,
    ROUTER_BIAS,
    SANDWICH_NORMS,
    SHARED_EXPERT,
    SINKS,
    WINDOWS,
    BlockShape,
    ModelPart,
)
from lctrain.config.registry import Registry

NORM_TILE_ELEMENTS = 2**26
"""Elements of the rows lctrain's RMSNorm backward recomputes at once (`models.norms.RMSNorm`):
its float32 working tensors are that many elements each, whatever the sequence length."""


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """config.json's model_type, and the value of model.family."""
    hf_class: str
    """The transformers model class of an exported checkpoint."""
    hf_config_class: str = ""
    """Its config class (default: the model class's name with Config for ForCausalLM)."""
    parts: tuple[ModelPart, ...] = ()
    """What its blocks have beyond a Llama block (`lctrain.config.model_parts`)."""
    module: str = ""
    """Its code: the module whose `FAMILY` declares it (`lctrain.models.families.FamilyCode`;
    default `lctrain.models.<name>`)."""

    def has(self, part: ModelPart) -> bool:
        return part in self.parts

    @property
    def mlp_activation(self) -> str:
        """The gated MLP's activation: silu (SwiGLU) | gelu_tanh (`GELU_TANH`)."""
        return "gelu_tanh" if self.has(GELU_TANH) else "silu"

    @property
    def summary(self) -> str:
        """What its blocks have beyond a Llama block, from its parts (`lctrain keys`)."""
        features = ", ".join(part.summary for part in self.parts)
        return f"{self.hf_class}: " + (features or "Llama's block")

    def __post_init__(self):
        if not self.hf_config_class:
            object.__setattr__(self, "hf_config_class",
                               self.hf_class.replace("ForCausalLM", "Config"))
        if not self.module:
            object.__setattr__(self, "module", f"lctrain.models.{self.name}")

    def block_extra_params(self, dim: int, head_dim: int, n_heads: int, n_kv_heads: int,
                           attention: bool = True) -> tuple[int, int]:
        """(parameters TP shards, parameters TP replicates) one block holds beyond a Llama
        block's: each part's (`ModelPart.sharded`, `replicated`; the MLP's extras:
        `lctrain.config.model_size.mlp_params`); with `attention` False, of a linear-attention
        block (the attention's parts left out)."""
        shape = BlockShape(dim, head_dim, n_heads, n_kv_heads)
        parts = [part for part in self.parts if attention or not part.in_attention]
        return (sum(part.sharded(shape) for part in parts),
                sum(part.replicated(shape) for part in parts))


MODEL_FAMILIES: Registry[ModelFamily] = Registry("model family")
for _family in (
    ModelFamily("llama", "LlamaForCausalLM"),
    ModelFamily("qwen2", "Qwen2ForCausalLM", parts=(QKV_BIAS, WINDOWS)),
    ModelFamily("qwen3", "Qwen3ForCausalLM", parts=(QK_NORM, WINDOWS)),
    ModelFamily("mistral", "MistralForCausalLM", parts=(WINDOWS,)),
    ModelFamily("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", module="lctrain.models.gemma3",
                parts=(QK_NORM, WINDOWS, SANDWICH_NORMS, NORM_OFFSET, GELU_TANH, EMBED_SCALE)),
    ModelFamily("qwen3_moe", "Qwen3MoeForCausalLM", parts=(QK_NORM, WINDOWS, EXPERTS)),
    ModelFamily("mixtral", "MixtralForCausalLM", parts=(WINDOWS, EXPERTS)),
    ModelFamily("gpt_oss", "GptOssForCausalLM", parts=(QKV_BIAS, WINDOWS, EXPERTS, OUT_BIAS,
                                                       SINKS, ROUTER_BIAS, EXPERT_BIAS)),
    ModelFamily("qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                module="lctrain.models.qwen3_5",
                parts=(QK_NORM, NORM_OFFSET, OUTPUT_GATE, LINEAR_ATTENTION)),
    ModelFamily("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                module="lctrain.models.qwen3_5_moe",
                parts=(QK_NORM, NORM_OFFSET, OUTPUT_GATE, LINEAR_ATTENTION, EXPERTS,
                       SHARED_EXPERT)),
    ModelFamily("qwen3_next", "Qwen3NextForCausalLM",
                parts=(QK_NORM, NORM_OFFSET, OUTPUT_GATE, LINEAR_ATTENTION, EXPERTS,
                       SHARED_EXPERT)),
):
    MODEL_FAMILIES.add(_family)


def model_family(name: str) -> ModelFamily:
    return MODEL_FAMILIES[name]
