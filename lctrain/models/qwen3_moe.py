"""Qwen3-MoE (config.json model_type qwen3_moe: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's
attention (QK-norm, explicit head_dim) and, in the layers `model.moe_layers` names (from
decoder_sparse_step and mlp_only_layers), a mixture of experts (lctrain.models.moe): a router
without bias, softmax then top-k with `norm_topk_prob`, experts of moe_intermediate_size. The
other layers keep a dense MLP of intermediate_size.
"""

from __future__ import annotations

from lctrain.config import ModelConfig
from lctrain.models.families import FamilyCode
from lctrain.models.qwen2 import windowed_hf_config


def moe_hf_config(cfg: ModelConfig, experts_key: str) -> dict:
    """The config keys of an MoE family's transformers config: the experts (under
    `experts_key`, num_experts or num_local_experts), k, the aux-loss weight."""
    return {experts_key: cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "output_router_logits": cfg.router_aux_loss_coef > 0}


def _hf_config(cfg: ModelConfig) -> dict:
    sparse = cfg.moe_layers if cfg.moe_layers is not None else range(cfg.n_layers)
    return {"attention_bias": False, **windowed_hf_config(cfg),
            **moe_hf_config(cfg, "num_experts"), "moe_intermediate_size": cfg.expert_dim,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(cfg.n_layers) if i not in sparse]}


EXPERT_PARAMS = {"feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
                 "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight",
                 "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight"}
"""The experts' stacked matrices -> the Hugging Face tensors of expert e, as the Qwen MoE
checkpoints store them (one per expert and projection)."""
FUSED_EXPERTS = {"feed_forward.experts.w1": ("mlp.experts.gate_up_proj", 0, 2),
                 "feed_forward.experts.w3": ("mlp.experts.gate_up_proj", 1, 2),
                 "feed_forward.experts.w2": ("mlp.experts.down_proj", 0, 1)}
"""The same matrices where a checkpoint holds all experts in one tensor, as transformers'
modules do: gate_up_proj [E, 2 F, D] (the gates, then the ups), down_proj [E, D, F]."""

FAMILY = FamilyCode(hf_config=_hf_config, hf_names={"feed_forward.router": "mlp.gate"},
                    hf_params=EXPERT_PARAMS, hf_fused=FUSED_EXPERTS)
