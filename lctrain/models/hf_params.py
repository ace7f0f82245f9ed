"""transformers' RoPE parameters for a model config (export: `lctrain.models.hf`, and the
families whose config classes take them per layer type)."""

from __future__ import annotations

from lctrain.config import ModelConfig


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' `rope_parameters` for the RoPE settings of `cfg`."""
    params = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        params["factor"] = cfg.rope_factor
    if cfg.rope_type == "llama3":
        params.update(low_freq_factor=cfg.rope_low_freq_factor,
                      high_freq_factor=cfg.rope_high_freq_factor,
                      original_max_position_embeddings=cfg.rope_original_max_position)
    if cfg.rope_type == "yarn":
        params.update(original_max_position_embeddings=cfg.rope_original_max_position,
                      beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                      truncate=cfg.rope_truncate)
    return params
