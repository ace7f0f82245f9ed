"""Llama (config.json model_type llama: Llama 2, 3, 3.1, 3.2, 3.3): the generic decoder
(lctrain.models.decoder) with no part beyond its own; every other family adds parts or names.
"""

from __future__ import annotations

from lctrain.models.families import FamilyCode

FAMILY = FamilyCode(hf_config=lambda _cfg: {"attention_bias": False, "mlp_bias": False})
