"""The one way to build a model (`new_model`) and to find a family's code (`family_code`): the
module its facts entry names (`lctrain.config.model_families.ModelFamily.module`), with the code
of its parts (`lctrain.models.parts`). The build order, the pipeline stages, checkpoints,
export, TP and the Hugging Face name map ask here, never for a class by name.
"""

from __future__ import annotations

import importlib
from functools import cache

from lctrain.config import ModelConfig
from lctrain.config.model_families import ModelFamily, model_family
from lctrain.models.blocks import AttentionCore, BlockParts, sdpa_attention
from lctrain.models.decoder import Decoder
from lctrain.models.families import FamilyCode
from lctrain.models.gated_deltanet import LOCAL_LINEAR, LinearCore
from lctrain.models.parts import parts_of


@cache
def _code(facts: ModelFamily) -> FamilyCode:
    return importlib.import_module(facts.module).FAMILY.with_parts(parts_of(facts))


def family_code(family: ModelConfig | str) -> FamilyCode:
    """The code of a family (by name, or a model config's): its module's `FAMILY` with its
    parts."""
    return _code(model_family(family if isinstance(family, str) else family.family))


def new_model(cfg: ModelConfig, core: AttentionCore = sdpa_attention,
              linear: LinearCore = LOCAL_LINEAR) -> Decoder:
    """The single-device model of `cfg` (on the current default device): the decoder whose
    blocks have the family's parts and call `core` (attention) and `linear` (linear-attention
    layers)."""
    code = family_code(cfg)
    return Decoder(cfg, BlockParts(core, code.parts, code.experts, linear=linear,
                                   linear_mixer=code.linear_mixer))
