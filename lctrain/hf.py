"""Hugging Face Llama interop: config and parameter-name mapping (weights are identical)."""

from __future__ import annotations

import re

from torch import Tensor

from lctrain.config import ModelConfig

# lctrain name pattern -> HF name pattern ({i} = layer id)
_LAYER_MAP = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def to_hf_name(name: str) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if m:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.weight"
    return f"{_TOP_MAP[name.removesuffix('.weight')]}.weight"


def to_hf_state_dict(state: dict[str, Tensor], tie_embeddings: bool) -> dict[str, Tensor]:
    out = {to_hf_name(k): v for k, v in state.items()}
    if tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def from_hf_state_dict(hf_state: dict[str, Tensor], tie_embeddings: bool) -> dict[str, Tensor]:
    inverse = {}
    for k, v in hf_state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", k)
        if m:
            name = {h: ours for ours, h in _LAYER_MAP.items()}[m.group(2)]
            inverse[f"layers.{m.group(1)}.{name}.weight"] = v
        else:
            inverse[{h: o for o, h in _TOP_MAP.items()}[k.removesuffix(".weight")] + ".weight"] = v
    if tie_embeddings:
        inverse["output.weight"] = inverse["tok_embeddings.weight"]
    return inverse


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
                      beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
    return params


def hf_config(cfg: ModelConfig, max_position_embeddings: int = 8192):
    """A transformers LlamaConfig with the same architecture as `cfg`."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg),
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
        max_position_embeddings=max_position_embeddings,
    )
