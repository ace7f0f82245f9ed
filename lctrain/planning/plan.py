"""The plan of a validated layout for a world size: per-rank shapes, memory and traffic, as plain
data (`lctrain plan` prints it as text or JSON).

No process, device or process group is created. Traffic: the formulas of
`lctrain.planning.traffic` (elements sent per rank). Memory (`lctrain.planning.memory`): fp32
master weights, gradients and AdamW moments (sharded over dp x cp by FSDP, replicated by DDP),
FSDP's gathered weights, the activations the forward keeps (blocks and head, exact against
measurement in fp32 and bf16; on the host with train.offload_activations) and the backward's
working set (an estimate).
"""

from __future__ import annotations

from lctrain.config import LctrainConfig, derive
from lctrain.config.validation import warnings_for
from lctrain.layout.topology import AXES, GROUPS, Topology
from lctrain.planning.memory import (
    activation_formula,
    gathered_weight_bytes,
    head_activation_formula,
    local_params,
    param_count,
    state_bytes_per_rank,
    working_bytes,
)
from lctrain.planning.traffic import (
    attention_traffic,
    dp_step_bytes,
    dp_step_traffic,
    tp_block_traffic,
)

GIB = 2**30


def attention_traffic_per_layer(cfg: LctrainConfig, world_size: int) -> dict[str, float]:
    """Elements sent per rank by one layer's attention (micro-batch of sequences)."""
    d = derive(cfg, world_size)
    m, p = cfg.model, cfg.parallel
    head_dim = m.dim // m.n_heads
    t = attention_traffic(p.attention, cfg.train.seq_len, m.dim // p.tp,
                          m.n_kv_heads * head_dim // p.tp * d.kv_replication, p.cp, d.cp_ulysses,
                          batch=cfg.train.micro_batch)
    return {f"{p.attention}_per_layer_fwd": t["forward"],
            f"{p.attention}_per_layer_bwd": t["backward"]}


def build_plan(cfg: LctrainConfig, world_size: int) -> dict:
    """Everything `lctrain plan` reports, as plain data (assumes `validate` passed)."""
    d = derive(cfg, world_size)
    topo = Topology.from_config(cfg, world_size)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    head_dim = m.dim // m.n_heads
    bytes_act = 2 if t.dtype == "bf16" else 4
    n_params = param_count(m)
    state_bytes = state_bytes_per_rank(cfg, world_size)
    tokens = t.micro_batch * d.local_seq_len         # per cp rank
    seq_div = p.tp if (p.sp and p.tp > 1) else 1
    kept = (activation_formula(cfg, world_size, t.micro_batch) * (m.n_layers // p.pp)
            + head_activation_formula(cfg, world_size, t.micro_batch))
    on_host = kept if t.offload_activations else 0.0
    gathered = gathered_weight_bytes(cfg, world_size)
    working = working_bytes(cfg, world_size, t.micro_batch)
    traffic = attention_traffic_per_layer(cfg, world_size) if p.cp > 1 else {}
    notes = list(warnings_for(cfg))
    if d.kv_replication > 1:
        notes.append(f"KV heads are replicated x{d.kv_replication} before the Ulysses all-to-all "
                     f"({m.n_kv_heads // p.tp} KV heads per TP rank, Ulysses degree "
                     f"{d.cp_ulysses})")
    gpus = cfg.slurm.gpus_per_node
    for name in ("tp", "cp_ulysses"):
        if topo.group_size(name) > 1 and any(len({r // gpus for r in g}) > 1
                                             for g in topo.groups(name)):
            notes.append(f"{name} groups span nodes (slurm.gpus_per_node={gpus}); keep "
                         f"tp x cp_ulysses <= {gpus} for intra-node links")
    return {
        "world_size": world_size,
        "layout": {a: getattr(topo, a) for a in AXES} | {"cp": p.cp, "sp": p.sp},
        "attention": p.attention if p.cp > 1 else "local",
        "load_balance": p.load_balance if p.cp > 1 else "none",
        "grad_accum": d.grad_accum,
        "activation_checkpointing": t.activation_checkpointing,
        "tokens_per_step": d.tokens_per_step,
        "kv_replication": d.kv_replication,
        "shapes": {
            "embedding_out [B, S/(cp*tp) or S/cp, D]":
                [t.micro_batch, t.seq_len // (p.cp * seq_div), m.dim],
            "qkv_local [B, S/cp, H/tp, d]": [t.micro_batch, d.local_seq_len, m.n_heads // p.tp,
                                             head_dim],
            "attention_core [B, S/cp_ring, H/(tp*cp_ulysses), d]":
                [t.micro_batch, t.seq_len // d.cp_ring, m.n_heads // (p.tp * d.cp_ulysses),
                 head_dim],
            "layers_per_stage": m.n_layers // p.pp,
        },
        "memory_gib": {
            "params_total_billion": n_params / 1e9,
            "weights_grads_adam": state_bytes / GIB,
            "fsdp_gathered_weights": gathered / GIB,
            "activations_kept": (kept - on_host) / GIB,
            "activations_on_host": on_host / GIB,
            "backward_working_set": working / GIB,
            "total_estimate": (state_bytes + gathered + kept - on_host + working) / GIB,
        },
        "traffic_elements_per_rank": {
            **traffic,
            "tp_per_layer_fwd": tp_block_traffic(tokens, m.dim, p.tp),
            f"{p.dp_engine}_per_step": dp_step_traffic(p.dp_engine, *local_params(cfg),
                                                       d.dp * p.cp, d.grad_accum),
            f"{p.dp_engine}_bytes_per_step": dp_step_bytes(p.dp_engine, *local_params(cfg),
                                                           d.dp * p.cp, d.grad_accum, bytes_act),
        },
        "groups": {name: {"axes": list(GROUPS[name][0]), "size": topo.group_size(name),
                          "carries": GROUPS[name][1]} for name in GROUPS},
        "ranks": [{"rank": r, "node": r // gpus, **topo.coords(r)} for r in range(world_size)],
        "notes": notes,
    }
