"""Mistral (config.json model_type mistral): Llama's blocks exactly; what differs is the
sliding attention window of config.json. A window that is null or at least the training
sequence is full attention, which is all lctrain computes; a shorter one is refused by
validation (`model.sliding_window`) until sliding-window attention exists.
"""

from __future__ import annotations

from lctrain.models.families import FamilyCode
from lctrain.models.llama import Attention

MISTRAL = FamilyCode("mistral", attention=Attention,
                     hf_config=lambda cfg: {"sliding_window": cfg.sliding_window})
