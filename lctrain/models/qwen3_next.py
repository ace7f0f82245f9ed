"""Qwen3-Next (config.json model_type qwen3_next: Qwen3-Next-80B-A3B): Qwen3.5's hybrid blocks
(`lctrain.models.qwen3_5`: Gated DeltaNet layers, three to each gated full-attention layer,
norms by 1 + w, partial RoPE) whose Gated DeltaNet projections are fused with their rows grouped
by key head (`lctrain.models.gated_deltanet.GroupedGatedDeltaNet`: `in_proj_qkvz`,
`in_proj_ba`), and Qwen3-MoE's mixtures of experts (decoder_sparse_step, mlp_only_layers,
norm_topk_prob) with a shared expert gated by sigmoid (the `shared_expert` part).
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode
from lctrain.models.gated_deltanet import GroupedGatedDeltaNet
from lctrain.models.qwen3_5 import LINEAR_PARAMS, QKV_ROWS, hybrid_hf_config
from lctrain.models.qwen3_moe import EXPERT_PARAMS, FUSED_EXPERTS, moe_hf_config

_LINEAR = ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj")


def _hf_config(cfg: ModelConfig) -> dict:
    sparse = cfg.moe_layers if cfg.moe_layers is not None else range(cfg.n_layers)
    return {**hybrid_hf_config(cfg), **moe_hf_config(cfg, "num_experts"),
            "moe_intermediate_size": cfg.expert_dim,
            "shared_expert_intermediate_size": cfg.shared_expert_ffn_dim,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(cfg.n_layers) if i not in sparse]}


FAMILY = FamilyCode(
    hf_config=_hf_config,
    hf_names={**{f"linear_attention.{name}": f"linear_attn.{name}" for name in _LINEAR},
              "feed_forward.router": "mlp.gate"},
    hf_params={**LINEAR_PARAMS, **EXPERT_PARAMS}, hf_fused=FUSED_EXPERTS, hf_rows=QKV_ROWS,
    linear_mixer=GroupedGatedDeltaNet)
