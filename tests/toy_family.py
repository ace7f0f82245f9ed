"""A toy model family with a part no family has, added the way docs/extending.md says: Llama's
blocks with a learnable scale on each value dimension (`v_scale`, one weight of head_dim shared
by the heads, applied before the attention).

This one module plays the part of the 4 files of lctrain/ a family with a new part touches:
`config/model_parts.py` (`VALUE_SCALE`, the part's facts), `models/parts.py` (`ValueScale`, its
code), `config/model_families.py` (`TOY`, the family's facts) and `models/<name>.py` (`FAMILY`,
what the family's module declares). Nothing is registered on import:
tests/test_model_parts.py registers the entries for the length of a test (`registered`), so no
other test sees them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import SequenceParallel

from lctrain.config import ModelConfig
from lctrain.config.model_families import ModelFamily
from lctrain.config.model_parts import ModelPart
from lctrain.models.families import FamilyCode
from lctrain.models.parts import HEADS_DIM, Part

# config/model_parts.py
VALUE_SCALE = ModelPart("value_scale", "a scale on each value dimension",
                        replicated=lambda s: s.head_dim)


# models/parts.py
class Scale(nn.Module):
    """x * w over the last dimension (w starts at one)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight

    def init_rules(self) -> dict[str, float | None]:
        return {"weight": None}


class ValueScale(Part):
    """v [B, S, H_kv, d] scaled by one weight of d. Under TP each rank scales its own heads
    (the heads dimension treated as the sharded one, so the weight's gradient is summed over
    the TP ranks, as Qwen3's head norms')."""

    hf_names = {"attention.v_scale": "self_attn.v_scale"}

    def tp_plan(self) -> dict:
        return {"attention.v_scale": SequenceParallel(sequence_dim=HEADS_DIM,
                                                      use_local_output=True)}

    def build_attention(self, attention: nn.Module, cfg: ModelConfig) -> None:
        attention.v_scale = Scale(cfg.d_head)

    def qkv(self, attention, q, k, v):
        return q, k, attention.v_scale(v)


# config/model_families.py
TOY = ModelFamily("toy_scaled", "LlamaForCausalLM", parts=(VALUE_SCALE,),
                  module="tests.toy_family")

# models/toy_scaled.py
FAMILY = FamilyCode(hf_config=lambda _cfg: {"attention_bias": False, "mlp_bias": False})
