"""Every model family's code, registered by name (the names of
`lctrain.config.model_families.MODEL_FAMILIES`), and the one way to build a model: `new_model`.
The build order, the pipeline stages, checkpoints, export, TP and the Hugging Face name map ask
here, never for a class by name.
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.config.registry import Registry
from lctrain.models.decoder import AttentionCore, Decoder, sdpa_attention
from lctrain.models.families import LLAMA, FamilyCode
from lctrain.models.gemma3 import GEMMA3
from lctrain.models.gpt_oss import GPT_OSS
from lctrain.models.mistral import MISTRAL
from lctrain.models.mixtral import MIXTRAL
from lctrain.models.qwen2 import QWEN2
from lctrain.models.qwen3 import QWEN3
from lctrain.models.qwen3_moe import QWEN3_MOE

FAMILY_CODE: Registry[FamilyCode] = Registry("model family's code")
for _code in (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA3, QWEN3_MOE, MIXTRAL, GPT_OSS):
    FAMILY_CODE.add(_code)


def family_code(cfg: ModelConfig) -> FamilyCode:
    return FAMILY_CODE[cfg.family]


def new_model(cfg: ModelConfig, core: AttentionCore = sdpa_attention) -> Decoder:
    """The single-device model of `cfg` (on the current default device): the decoder with the
    family's attention in every block, calling `core`."""
    code = family_code(cfg)
    return Decoder(cfg, core, code.attention, code.experts)
