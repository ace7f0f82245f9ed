"""What a model family's module declares (`FamilyCode`): what its parts
(`lctrain.models.parts`) and the facts of `lctrain.config.model_families` do not say. A family is
one module under lctrain/models/ that ends with `FAMILY = FamilyCode(...)`; its facts entry
names it (`ModelFamily.module`) and `lctrain.models.registry` finds it there, so the build order,
the pipeline stages, checkpoints, export and the Hugging Face name map ask the registry
(`new_model`, `family_code`), never a class by name. docs/extending.md is the checklist for
adding one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lctrain.config import ModelConfig
from lctrain.models.gated_deltanet import GatedDeltaNet
from lctrain.models.moe import Experts
from lctrain.models.parts import Part


@dataclass(frozen=True)
class FamilyCode:
    hf_config: Callable[[ModelConfig], dict[str, Any]] = lambda _cfg: {}
    """Keyword arguments of the transformers config class beyond (or replacing) the common
    ones, for export."""
    hf_names: dict[str, str] = field(default_factory=dict)
    """lctrain module path inside a block -> Hugging Face path, beyond (or instead of) Llama's
    and its parts' (a mixture of experts' router: mlp.gate, mlp.router, block_sparse_moe.gate);
    weights and biases map alike."""
    hf_params: dict[str, str] = field(default_factory=dict)
    """Parameters (not weights or biases of a module) by their lctrain path inside a block ->
    their Hugging Face name inside `model.layers.{i}`, beyond its parts'; a stacked expert
    matrix [E, ...] whose checkpoints store one tensor per expert names expert e's with "{e}"
    (Qwen3-MoE's `mlp.experts.{e}.gate_proj.weight`)."""
    hf_fused: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """A stacked expert matrix that `hf_params` names one tensor per expert, where a checkpoint
    may hold all experts in one tensor instead (as transformers' modules hold them: the
    released Qwen3.5-MoE checkpoints): lctrain path inside a block -> (that tensor's name
    inside `model.layers.{i}`, which of its equal parts along dim 1 this matrix is, how many
    parts). Loading reads it when the per-expert tensors are absent."""
    hf_rows: dict[str, Callable[[ModelConfig], Tensor]] = field(default_factory=dict)
    """Parameters whose rows lctrain holds in another order than Hugging Face's (a Gated
    DeltaNet's Q/K/V projection and convolution, grouped by key head so that TP splits them by
    rows): lctrain path inside a block -> (model config) -> index [rows], lctrain's row i being
    Hugging Face's row index[i]. Loading, export and the state-dict maps reorder them."""
    experts: Callable[..., nn.Module] = Experts
    """Builds a mixture-of-experts layer's experts: (ModelConfig, activation) -> module
    (`lctrain.models.moe.Experts` or a subclass)."""
    linear_mixer: Callable[..., nn.Module] = GatedDeltaNet
    """Builds a linear-attention layer's mixer: (LinearShape, init std, output init std, core)
    -> module (`lctrain.models.gated_deltanet.GatedDeltaNet` or a subclass: Qwen3-Next's fused
    projections)."""
    parts: tuple[Part, ...] = ()
    """The code of its parts (filled by `lctrain.models.registry.family_code` from the
    facts)."""

    def with_parts(self, parts: tuple[Part, ...]) -> FamilyCode:
        """This declaration with its parts' Hugging Face names added (its own win)."""
        names = {k: v for part in parts for k, v in part.hf_names.items()}
        params = {k: v for part in parts for k, v in part.hf_params.items()}
        return FamilyCode(self.hf_config, {**names, **self.hf_names},
                          {**params, **self.hf_params}, self.hf_fused, self.hf_rows,
                          self.experts, self.linear_mixer, parts)

    def tp_plan(self) -> dict[str, Any]:
        """Tensor-parallel styles of its parts' modules inside a block, beyond Llama's
        (lctrain.parallel.tensor adds them)."""
        return {k: v for part in self.parts for k, v in part.tp_plan().items()}

    @property
    def block_norms(self) -> tuple[str, ...]:
        """A block's norms beyond Llama's two (which sequence parallelism shards like them)."""
        return tuple(norm for part in self.parts for norm in part.block_norms)
