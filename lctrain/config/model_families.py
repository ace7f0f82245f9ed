"""The model families, as every layer but the model code sees them: one registry entry per family
holding its name (config.json's `model_type`, the value of `model.family`) and the features
that change what a block holds, so that validation, the parameter and FLOP counts, the memory
formulas and the planner ask the entry instead of comparing names.

The code of a family (its blocks, its Hugging Face names, its config.json rules, its TP plan
entries) is registered under the same name in `lctrain.models.registry` (the entry's fields:
`lctrain.models.families.FamilyCode`); docs/extending.md is the checklist for adding one. This module imports nothing from lctrain but the registry: it sits
in the config layer, so that the schema reads its names (`one_of(registry=MODEL_FAMILIES)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lctrain.config.registry import Registry

QK_NORMS = 2
"""The per-head RMSNorms of a `qk_norm` family: one for Q, one for K."""

NORM_TILE_ELEMENTS = 2**26
"""Elements of the rows lctrain's RMSNorm backward recomputes at once (`models.llama.RMSNorm`):
its float32 working tensors are that many elements each, whatever the sequence length."""
SANDWICH_NORMS = 2
"""The extra block norms of a `sandwich_norms` family: after the attention, after the MLP."""


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """config.json's model_type, and the value of model.family."""
    hf_class: str
    """The transformers model class of an exported checkpoint."""
    hf_config_class: str = ""
    """Its config class (default: the model class's name with Config for ForCausalLM)."""
    qkv_bias: bool = False
    """Q, K and V projections carry biases (sharded with their columns under TP)."""
    qk_norm: bool = False
    """An RMSNorm over each head's dims on Q and K, before RoPE (replicated under TP)."""
    sliding_window: bool = False
    """config.json may set a sliding attention window (model.sliding_window) and which layers
    use it (model.layer_types)."""
    sandwich_norms: bool = False
    """An RMSNorm on the attention's output and one on the MLP's, before each residual add
    (Gemma: `post_attention_layernorm`, `post_feedforward_layernorm`)."""
    norm_offset: bool = False
    """Every RMSNorm scales by 1 + w (w starts at zero; Gemma), not by w."""
    mlp_activation: str = "silu"
    """The gated MLP's activation: silu (SwiGLU) | gelu_tanh (GeGLU with tanh GELU, Gemma)."""
    embed_scale: bool = False
    """The embedding's output is multiplied by sqrt(dim) (Gemma)."""
    moe: bool = False
    """Its MLPs are mixtures of experts (model.n_experts, lctrain.models.moe)."""
    out_bias: bool = False
    """The attention's output projection carries a bias (GPT-OSS; replicated under TP)."""
    sinks: bool = False
    """Each attention layer has a learnable sink logit per query head (GPT-OSS;
    docs/parallelism.md §26)."""
    router_bias: bool = False
    """The experts' router carries a bias (GPT-OSS)."""
    expert_bias: bool = False
    """Each expert's projections carry biases (GPT-OSS: 2 F_e + D per expert)."""

    @property
    def summary(self) -> str:
        """What its blocks have beyond a Llama block, from the flags above (`lctrain keys`)."""
        features = [label for flag, label in (
            (self.qkv_bias, "Q/K/V biases"), (self.qk_norm, "Q and K head norms"),
            (self.sliding_window, "window layers"), (self.sandwich_norms, "sandwich norms"),
            (self.norm_offset, "norms scale by 1 + w"),
            (self.mlp_activation != "silu", f"gated MLP with {self.mlp_activation}"),
            (self.embed_scale, "embedding scaled by sqrt(dim)"),
            (self.moe, "mixtures of experts"), (self.out_bias, "output projection bias"),
            (self.sinks, "attention sinks"), (self.router_bias, "router bias"),
            (self.expert_bias, "expert biases")) if flag]
        return f"{self.hf_class}: " + (", ".join(features) if features else "Llama's block")

    def __post_init__(self):
        if not self.hf_config_class:
            object.__setattr__(self, "hf_config_class",
                               self.hf_class.replace("ForCausalLM", "Config"))

    def block_extra_params(self, dim: int, head_dim: int, n_heads: int,
                           n_kv_heads: int) -> tuple[int, int]:
        """(parameters TP shards, parameters TP replicates) one block holds beyond a Llama
        block's: the Q/K/V biases (one per output column), the sinks (one per query head), the
        two head norms, the two sandwich norms and the output projection's bias (the MLP's
        extras: `lctrain.config.model_size.mlp_params`)."""
        sharded = head_dim * (n_heads + 2 * n_kv_heads) if self.qkv_bias else 0
        sharded += n_heads if self.sinks else 0
        replicated = QK_NORMS * head_dim if self.qk_norm else 0
        replicated += SANDWICH_NORMS * dim if self.sandwich_norms else 0
        replicated += dim if self.out_bias else 0
        return sharded, replicated


MODEL_FAMILIES: Registry[ModelFamily] = Registry("model family")
for _family in (
    ModelFamily("llama", "LlamaForCausalLM"),
    ModelFamily("qwen2", "Qwen2ForCausalLM", qkv_bias=True, sliding_window=True),
    ModelFamily("qwen3", "Qwen3ForCausalLM", qk_norm=True, sliding_window=True),
    ModelFamily("mistral", "MistralForCausalLM", sliding_window=True),
    ModelFamily("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", qk_norm=True,
                sliding_window=True, sandwich_norms=True, norm_offset=True,
                mlp_activation="gelu_tanh", embed_scale=True),
    ModelFamily("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, sliding_window=True,
                moe=True),
    ModelFamily("mixtral", "MixtralForCausalLM", sliding_window=True, moe=True),
    ModelFamily("gpt_oss", "GptOssForCausalLM", qkv_bias=True, sliding_window=True, moe=True,
                out_bias=True, sinks=True, router_bias=True, expert_bias=True),
):
    MODEL_FAMILIES.add(_family)


def model_family(name: str) -> ModelFamily:
    return MODEL_FAMILIES[name]
