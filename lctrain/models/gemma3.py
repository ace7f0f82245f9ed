"""Gemma 3 text models (config.json model_type gemma3_text: Gemma 3 1B, and the language model of
4B/12B/27B): Llama's decoder with the parts its facts entry lists (`lctrain.config.
model_families`): head norms on Q and K, a norm after the attention and one after the MLP
(sandwich norms, which also rename the norm before the MLP in Hugging Face's names), every
RMSNorm scaling by 1 + w, a GeGLU MLP with tanh GELU, the embedding multiplied by sqrt(dim);
scores scaled by query_pre_attn_scalar^-1/2, and five sliding-window layers to one full layer,
the sliding ones with their own RoPE base (model.rope_local_theta).
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode
from lctrain.models.hf_params import rope_parameters


def _hf_config(cfg: ModelConfig) -> dict:
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": cfg.sliding_window,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.d_head,
            "layer_types": [cfg.layer_type(i) for i in range(cfg.n_layers)],
            "rope_parameters": {"full_attention": rope_parameters(cfg),
                                "sliding_attention": local},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "attention_bias": False}


FAMILY = FamilyCode(hf_config=_hf_config)
