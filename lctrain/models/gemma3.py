"""Gemma 3 text models (config.json model_type gemma3_text: Gemma 3 1B, and the language model of
4B/12B/27B): Qwen3's head norms on Q and K, and Llama's decoder changed where
`lctrain.config.model_families` says so: a norm after the attention and one after the MLP
(sandwich norms), every RMSNorm scaling by 1 + w, a GeGLU MLP with tanh GELU, the embedding
multiplied by sqrt(dim), scores scaled by query_pre_attn_scalar^-1/2, and five sliding-window
layers to one full layer, the sliding ones with their own RoPE base (model.rope_local_theta).

Hugging Face names: Llama's `post_attention_layernorm` is Gemma's norm after the attention, so
the block norm before the MLP (lctrain's `ffn_norm`) is `pre_feedforward_layernorm` here.
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode
from lctrain.models.hf_params import rope_parameters
from lctrain.models.qwen3 import QWEN3, Qwen3Attention


def _hf_config(cfg: ModelConfig) -> dict:
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    return {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": cfg.sliding_window,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.d_head,
            "layer_types": [cfg.layer_type(i) for i in range(cfg.n_layers)],
            "rope_parameters": {"full_attention": rope_parameters(cfg),
                                "sliding_attention": local},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "attention_bias": False}


GEMMA3 = FamilyCode("gemma3_text", attention=Qwen3Attention,
                    hf_names={**QWEN3.hf_names, "ffn_norm": "pre_feedforward_layernorm",
                              "attention_out_norm": "post_attention_layernorm",
                              "ffn_out_norm": "post_feedforward_layernorm"},
                    tp_plan=QWEN3.tp_plan, hf_config=_hf_config,
                    block_norms=("attention_out_norm", "ffn_out_norm"))
