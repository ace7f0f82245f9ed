"""Qwen3 dense models (config.json model_type qwen3): Llama's decoder with an RMSNorm over each
query and key head before RoPE (`q_norm`, `k_norm`, one weight of head_dim each) and an explicit
head_dim (H x d need not equal dim: Qwen3-0.6B has 16 heads of 128 on a 1024 model).

Under tensor parallelism the head norms are replicated and each rank normalises its own heads;
their weights' gradients are summed over the TP ranks by treating the heads dimension as the
sharded one (torch's SequenceParallel style on dim 2), as the block norms are under SP.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor.parallel import SequenceParallel

from lctrain.config import ModelConfig
from lctrain.config.model_families import model_family
from lctrain.models.decoder import Attention, AttentionCore, RMSNorm, sdpa_attention
from lctrain.models.families import FamilyCode
from lctrain.models.qwen2 import windowed_hf_config

HEADS_DIM = 2
"""The heads dimension of q and k [B, S, H, d]: what TP shards."""


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig, core: AttentionCore = sdpa_attention):
        super().__init__(cfg, core)
        offset = model_family(cfg.family).norm_offset  # Gemma 3's head norms scale by 1 + w
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, offset)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, offset)

    def head_norms(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.q_norm(q), self.k_norm(k)


def _tp_plan() -> dict:
    return {name: SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)
            for name in ("attention.q_norm", "attention.k_norm")}


QWEN3 = FamilyCode("qwen3", attention=Qwen3Attention,
                   hf_names={"attention.q_norm": "self_attn.q_norm",
                             "attention.k_norm": "self_attn.k_norm"},
                   tp_plan=_tp_plan,
                   hf_config=lambda cfg: {"attention_bias": False, **windowed_hf_config(cfg)})
