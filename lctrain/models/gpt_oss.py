"""GPT-OSS (config.json model_type gpt_oss: gpt-oss-20b, gpt-oss-120b): attention with biases
on Q, K, V and the output projection, a learnable sink logit per head (docs/parallelism.md
§26), sliding-window layers (128 tokens) alternating with full ones, YaRN RoPE without
truncation; every MLP a mixture of experts (lctrain.models.moe) whose router has a bias and
whose experts are `GptOssExperts` (biases, the clamped SwiGLU, the checkpoints' interleaved
gate/up layout). Its top-k-then-softmax routing equals softmax, top-k and renormalisation.
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode
from lctrain.models.moe import GptOssExperts
from lctrain.models.qwen3_moe import moe_hf_config


def _hf_config(cfg: ModelConfig) -> dict:
    return {"attention_bias": True, "sliding_window": cfg.sliding_window,
            "layer_types": [cfg.layer_type(i) for i in range(cfg.n_layers)],
            "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
            **moe_hf_config(cfg, "num_local_experts")}


FAMILY = FamilyCode(
    hf_config=_hf_config, hf_names={"feed_forward.router": "mlp.router"},
    hf_params={f"feed_forward.experts.{name}": f"mlp.experts.{name}"
               for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")},
    experts=GptOssExperts)
