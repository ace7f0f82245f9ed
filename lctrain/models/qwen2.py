"""Qwen2 and Qwen2.5 (config.json model_type qwen2): Llama's decoder with biases on the Q, K
and V projections (zeros at init; under TP each rank holds the biases of its columns). A
sliding window is read only where config.json turns it on (use_sliding_window).
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode
from lctrain.models.llama import Attention


def windowed_hf_config(cfg: ModelConfig) -> dict:
    """The sliding-window keys of Qwen2's and Qwen3's config classes: on for every layer when
    model.sliding_window is set (lctrain trains no window shorter than the sequence), else
    off."""
    window = cfg.sliding_window
    return {"use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": 0 if window is not None else cfg.n_layers}


QWEN2 = FamilyCode("qwen2", attention=Attention,  # the biases: ModelFamily.qkv_bias
                   hf_config=windowed_hf_config)
