"""Qwen2 and Qwen2.5 (config.json model_type qwen2): Llama's decoder with biases on the Q, K
and V projections (the `qkv_bias` part: zeros at init; under TP each rank holds the biases of
its columns). A sliding window is read only where config.json turns it on (use_sliding_window).
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode


def windowed_hf_config(cfg: ModelConfig) -> dict:
    """The sliding-window keys of Qwen2's and Qwen3's config classes: on, with each layer's
    type, when model.sliding_window is set, else off."""
    window = cfg.sliding_window
    if window is None:
        return {"use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.n_layers}
    return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0,
            "layer_types": [cfg.layer_type(i) for i in range(cfg.n_layers)]}


FAMILY = FamilyCode(hf_config=windowed_hf_config)
