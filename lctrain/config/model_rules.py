"""The rules of the model's own fields: where attention windows may be and which layers use them,
the linear-attention layers, and the mixture-of-experts fields with the layouts their experts run in (expert parallelism's
sizes; no TP without SP, no DeepSpeed engine). Part of `lctrain.config.validation`'s `validate`.
"""

from __future__ import annotations

import math

from lctrain.config.model_families import model_family
from lctrain.config.model_parts import EXPERTS, LINEAR_ATTENTION, SHARED_EXPERT, WINDOWS
from lctrain.config.schema import FULL, LINEAR, SLIDING, LctrainConfig, ModelConfig


def window_problems(cfg: LctrainConfig) -> list[str]:
    """model.sliding_window and model.layer_types: a window only where the family has one, one
    layer type per layer, sliding layers only with a window."""
    m = cfg.model
    problems = []
    if m.sliding_window is not None and not model_family(m.family).has(WINDOWS):
        problems.append(f"model.sliding_window={m.sliding_window} with model.family={m.family}, "
                        "which has no attention window; set model.sliding_window=null")
    if m.layer_types is None:
        return problems
    if len(m.layer_types) != m.n_layers:
        problems.append(f"model.layer_types has {len(m.layer_types)} entries for "
                        f"model.n_layers={m.n_layers}; give one per layer (or null)")
    linear = model_family(m.family).has(LINEAR_ATTENTION)
    kinds = [FULL, SLIDING, *([LINEAR] if linear else [])]
    unknown = sorted(set(m.layer_types) - set(kinds))
    if unknown:
        problems.append(f"model.layer_types has {unknown}; each layer of model.family="
                        f"{m.family} is {' or '.join(kinds)}")
    if SLIDING in m.layer_types and m.sliding_window is None:
        problems.append(f"model.layer_types has {SLIDING} layers but model.sliding_window is "
                        "null; set the window (e.g. model.sliding_window=4096)")
    return problems


def linear_problems(cfg: LctrainConfig) -> list[str]:
    """Gated DeltaNet layers: their heads, which TP and the head split divide."""
    m, p = cfg.model, cfg.parallel
    if LINEAR not in (m.layer_types or ()):
        return []
    problems = []
    if m.linear_value_heads % m.linear_key_heads:
        problems.append(f"model.linear_value_heads={m.linear_value_heads} is not a multiple of "
                        f"model.linear_key_heads={m.linear_key_heads}: each key head serves "
                        "whole value heads")
    if m.linear_key_heads % p.tp:
        problems.append(f"parallel.tp={p.tp} does not divide model.linear_key_heads="
                        f"{m.linear_key_heads}: TP splits the linear layers by key heads (each "
                        "with its value heads); choose a tp that divides them")
    elif p.cp > 1 and p.linear_cp == "heads" and (m.linear_key_heads // p.tp) % p.cp:
        problems.append(f"parallel.linear_cp=heads splits the linear layers' "
                        f"{m.linear_key_heads // p.tp} key heads per TP rank over parallel.cp="
                        f"{p.cp} ranks, which does not divide them; set parallel.linear_cp=state")
    return problems


def expert_problems(cfg: LctrainConfig, world_size: int) -> list[str]:
    """The mixture-of-experts fields: experts only in a family that has them (and then some),
    k of them per token, MoE layers that exist; the layouts MoE layers do not run in yet."""
    m, p = cfg.model, cfg.parallel
    family = model_family(m.family)
    if p.ep > 1 and not (family.has(EXPERTS) and m.n_experts):
        return [f"parallel.ep={p.ep} splits a mixture of experts, but model.family={m.family} "
                f"(model.n_experts={m.n_experts}) has none; set parallel.ep=1"]
    if not family.has(EXPERTS):
        return _shared_expert(m) + ([] if m.n_experts == 0 else [
            f"model.n_experts={m.n_experts} with model.family={m.family}, whose MLPs are dense; "
            "set model.n_experts=0, or a family with experts (qwen3_moe, mixtral)"])
    if m.n_experts == 0:
        return [f"model.family={m.family} is a mixture of experts: set model.n_experts (e.g. "
                "model.n_experts=8) or start from its config.json (model.init_from)"]
    problems = _shared_expert(m)
    if m.experts_per_token > m.n_experts:
        problems.append(f"model.experts_per_token={m.experts_per_token} exceeds model.n_experts="
                        f"{m.n_experts}; route each token to at most {m.n_experts}")
    if m.moe_layers is not None:
        bad = sorted({i for i in m.moe_layers if not 0 <= i < m.n_layers})
        if bad or len(set(m.moe_layers)) != len(m.moe_layers):
            problems.append(f"model.moe_layers={list(m.moe_layers)} must name distinct layers "
                            f"0..{m.n_layers - 1}" + (f" (not {bad})" if bad else ""))
    problems += _expert_parallel(cfg, world_size)
    moe = f"with a mixture-of-experts model (model.n_experts={m.n_experts})"
    if p.tp > 1 and not p.sp:
        problems.append(f"parallel.tp={p.tp} without parallel.sp {moe}: every TP rank would hold "
                        "the same tokens and compute the same experts; set parallel.sp=true "
                        "(each TP rank then routes its own sequence shard) or parallel.tp=1")
    if p.dp_engine == "deepspeed":
        problems.append(f"parallel.dp_engine=deepspeed {moe}: lctrain does not lay experts out "
                        "on DeepSpeed's engine yet; set parallel.dp_engine=fsdp")
    return problems


def _shared_expert(m: ModelConfig) -> list[str]:
    """A shared expert's width set exactly in the families that have one."""
    if model_family(m.family).has(SHARED_EXPERT) == (m.shared_expert_ffn_dim is not None):
        return []
    if m.shared_expert_ffn_dim is None:
        return [f"model.family={m.family} has a shared expert in every mixture of experts: set "
                "model.shared_expert_ffn_dim (config.json's shared_expert_intermediate_size) "
                "or start from its config.json (model.init_from)"]
    return [f"model.shared_expert_ffn_dim={m.shared_expert_ffn_dim} with model.family="
            f"{m.family}, which has no shared expert; set model.shared_expert_ffn_dim=null"]


def _expert_parallel(cfg: LctrainConfig, world_size: int) -> list[str]:
    """parallel.ep: whole experts per rank, ep ranks inside dp x cp x tp, FSDP over the rest."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return []
    problems = []
    if m.n_experts % p.ep:
        problems.append(f"parallel.ep={p.ep} does not divide model.n_experts={m.n_experts}; "
                        f"try parallel.ep={math.gcd(m.n_experts, p.ep)}")
    dp = p.dp if p.dp != -1 else world_size // (p.tp * p.cp * p.pp)
    if dp >= 1 and (dp * p.cp * p.tp) % p.ep:
        problems.append(f"parallel.ep={p.ep} must divide dp x cp x tp = {dp} x {p.cp} x {p.tp}: "
                        "the expert ranks are data, context and tensor ranks; try parallel.ep="
                        f"{math.gcd(dp * p.cp * p.tp, p.ep)}")

    return problems
