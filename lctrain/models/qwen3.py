"""Qwen3 dense models (config.json model_type qwen3): Llama's decoder with an RMSNorm over each
query and key head before RoPE (the `qk_norm` part: `lctrain.models.parts.HeadNorms`) and an
explicit head_dim (H x d need not equal dim: Qwen3-0.6B has 16 heads of 128 on a 1024 model).
"""

from __future__ import annotations

from lctrain.models.families import FamilyCode
from lctrain.models.qwen2 import windowed_hf_config

FAMILY = FamilyCode(hf_config=lambda cfg: {"attention_bias": False, **windowed_hf_config(cfg)})
