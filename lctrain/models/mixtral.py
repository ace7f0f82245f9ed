"""Mixtral (config.json model_type mixtral: Mixtral 8x7B, 8x22B): Mistral's blocks with every
MLP a mixture of experts (lctrain.models.moe): a router without bias, softmax then top-k
renormalised, experts as wide as intermediate_size; checkpoints name them
block_sparse_moe.experts.{e}.w1/w2/w3.
"""

from __future__ import annotations

from lctrain.models.families import FamilyCode
from lctrain.models.qwen3_moe import moe_hf_config

FAMILY = FamilyCode(
    hf_config=lambda cfg: {"sliding_window": cfg.sliding_window,
                           **moe_hf_config(cfg, "num_local_experts")},
    hf_names={"feed_forward.router": "block_sparse_moe.gate"},
    hf_params={f"feed_forward.experts.{w}": f"block_sparse_moe.experts.{{e}}.{w}.weight"
               for w in ("w1", "w2", "w3")})
