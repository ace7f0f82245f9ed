"""Qwen3.5 mixtures of experts (config.json model_type qwen3_5_moe_text; the language model of
the released qwen3_5_moe checkpoints: Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's hybrid
blocks (`lctrain.models.qwen3_5`) whose every MLP is a mixture of experts (softmax, top-k,
always renormalised) with a shared expert gated by sigmoid (the `shared_expert` part).
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode
from lctrain.models.qwen3_5 import HYBRID_ROWS, LINEAR_NAMES, LINEAR_PARAMS, hybrid_hf_config
from lctrain.models.qwen3_moe import EXPERT_PARAMS, FUSED_EXPERTS, moe_hf_config


def _hf_config(cfg: ModelConfig) -> dict:
    return {**hybrid_hf_config(cfg), **moe_hf_config(cfg, "num_experts"),
            "moe_intermediate_size": cfg.expert_dim,
            "shared_expert_intermediate_size": cfg.shared_expert_ffn_dim}


FAMILY = FamilyCode(hf_config=_hf_config,
                    hf_names={**LINEAR_NAMES, "feed_forward.router": "mlp.gate"},
                    hf_params={**LINEAR_PARAMS, **EXPERT_PARAMS}, hf_fused=FUSED_EXPERTS,
                    hf_rows=HYBRID_ROWS)
