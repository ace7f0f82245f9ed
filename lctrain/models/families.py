"""What a model family's code entry holds (`FamilyCode`): what `lctrain.config.model_families`
(the facts every layer reads) does not. A family is one module under lctrain/models/ that ends
with its entry; `lctrain.models.registry` registers them all, and the build order, the pipeline
stages, checkpoints, export and the Hugging Face name map ask it (`new_model`, `family_code`),
never a class by name. Llama's entry is here: the other families change its decoder.
docs/extending.md is the checklist for adding one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lctrain.config import ModelConfig
from lctrain.models.decoder import Attention
from lctrain.models.moe import Experts


@dataclass(frozen=True)
class FamilyCode:
    name: str
    """The family's name in `lctrain.config.model_families.MODEL_FAMILIES`."""
    attention: Callable[..., nn.Module]
    """Builds a block's attention: (ModelConfig, core) -> module (lctrain.models.decoder's
    `Attention` or a subclass)."""
    hf_names: dict[str, str] = field(default_factory=dict)
    """lctrain module path inside a block -> Hugging Face path, beyond (or instead of) Llama's
    (e.g. attention.q_norm -> self_attn.q_norm); weights and biases map alike."""
    tp_plan: Callable[[], dict[str, Any]] = dict
    """Tensor-parallel styles of the family's own modules inside a block, beyond Llama's
    (lctrain.parallel.tensor adds them). Biases need none: they shard with their columns."""
    hf_config: Callable[[ModelConfig], dict[str, Any]] = lambda _cfg: {}
    """Keyword arguments of the transformers config class beyond (or replacing) the common
    ones, for export."""
    block_norms: tuple[str, ...] = ()
    """A block's norms beyond Llama's two (which sequence parallelism shards like them)."""
    hf_params: dict[str, str] = field(default_factory=dict)
    """Parameters (not weights or biases of a module) by their lctrain path inside a block ->
    their Hugging Face name inside `model.layers.{i}`; a stacked expert matrix [E, ...] whose
    checkpoints store one tensor per expert names expert e's with "{e}" (Qwen3-MoE's
    `mlp.experts.{e}.gate_proj.weight`)."""
    experts: Callable[..., nn.Module] = Experts
    """Builds a mixture-of-experts layer's experts: (ModelConfig, activation) -> module
    (`lctrain.models.moe.Experts` or a subclass)."""


LLAMA = FamilyCode("llama", attention=Attention,
                   hf_config=lambda _cfg: {"attention_bias": False, "mlp_bias": False})
"""Llama: the generic decoder (lctrain.models.decoder) as it is; every other family changes
it."""
