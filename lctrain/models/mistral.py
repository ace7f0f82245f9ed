"""Mistral (config.json model_type mistral): Llama's blocks exactly; what differs is the
sliding attention window of config.json (v0.1: 4096 on every layer; v0.3: none), which every
layer applies (the `windows` part, `model.sliding_window`; one at least the training sequence is
full attention).
"""

from __future__ import annotations

from lctrain.models.families import FamilyCode

FAMILY = FamilyCode(hf_config=lambda cfg: {"sliding_window": cfg.sliding_window})
