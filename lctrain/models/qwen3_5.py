"""Qwen3.5 dense models (config.json model_type qwen3_5_text; the language model of the released
qwen3_5 checkpoints): a hybrid of Gated DeltaNet layers (`lctrain.models.gated_deltanet`, the
`linear_attention` part: model.layer_types names them, three before each full-attention layer
in the releases) and full attention with Qwen3's head norms, a sigmoid gate on the attention's
output (`output_gate`), RoPE over the first quarter of each head (model.rotary_fraction) and
every RMSNorm but the mixer's gated one scaling by 1 + w (`norm_offset`).
"""

from __future__ import annotations

from torch import Tensor

from lctrain.attention.delta_rule import LinearHeads
from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode
from lctrain.models.gated_deltanet import grouped_to_qkv
from lctrain.models.hf_params import rope_parameters


def hf_qkv_rows(cfg: ModelConfig) -> Tensor:
    """Where lctrain's Q/K/V channels (grouped by key head,
    `lctrain.models.gated_deltanet.grouped_to_qkv`) are in Hugging Face's in_proj_qkv and
    conv1d (every Q, every K, every V)."""
    heads = LinearHeads(cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_heads,
                        cfg.linear_value_dim)
    return grouped_to_qkv(heads).argsort()


QKV_ROWS = {"linear_attention.conv1d.weight": hf_qkv_rows}
"""The convolution's kernels, per channel in Hugging Face's checkpoints of every family."""
HYBRID_ROWS = {**QKV_ROWS, "linear_attention.in_proj_qkv.weight": hf_qkv_rows}
"""Qwen3.5's reordered rows: the convolution's and its Q/K/V projection's."""

_LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj")


def hybrid_hf_config(cfg: ModelConfig) -> dict:
    """The config keys of Qwen3.5's hybrid layers: their types, partial RoPE, the linear
    heads and dims."""
    return {"layer_types": [cfg.layer_type(i) for i in range(cfg.n_layers)],
            "rope_parameters": {**rope_parameters(cfg),
                                "partial_rotary_factor": cfg.rotary_fraction},
            "linear_num_key_heads": cfg.linear_key_heads,
            "linear_num_value_heads": cfg.linear_value_heads,
            "linear_key_head_dim": cfg.linear_key_dim,
            "linear_value_head_dim": cfg.linear_value_dim,
            "linear_conv_kernel_dim": cfg.linear_conv_kernel, "attention_bias": False}


LINEAR_NAMES = {f"linear_attention.{name}": f"linear_attn.{name}" for name in _LINEAR}
"""The Gated DeltaNet mixer's modules -> their Hugging Face names."""
LINEAR_PARAMS = {"linear_attention.A_log": "linear_attn.A_log",
                 "linear_attention.dt_bias": "linear_attn.dt_bias"}
"""Its parameters that are not a module's weight -> their Hugging Face names."""

FAMILY = FamilyCode(hf_config=hybrid_hf_config, hf_names=LINEAR_NAMES, hf_params=LINEAR_PARAMS,
                    hf_rows=HYBRID_ROWS)
