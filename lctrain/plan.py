"""`lctrain plan`: validate a layout for a world size and predict per-rank shapes, memory, traffic.

No process, device or process group is created. Traffic follows ../shared/seed/DIGEST.md section 4
(elements sent per rank per attention forward) and the textbook ring collectives for TP/SP and
FSDP; memory counts fp32 master weights, gradients and AdamW moments sharded by FSDP over dp x cp,
plus activations from lctrain.memory's formula (exact in float32 against measurement; bf16
tensors counted at half) and the fp32 logits.
"""

from __future__ import annotations

import json
import sys

from lctrain.attention.traffic import attention_traffic
from lctrain.config import LctrainConfig, ModelConfig, derive
from lctrain.memory import activation_formula
from lctrain.topology import AXES, GROUPS, Topology

GIB = 2**30


def param_count(m: ModelConfig) -> int:
    head_dim = m.dim // m.n_heads
    attn = m.dim * head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    block = attn + 3 * m.dim * m.ffn_dim + 2 * m.dim
    head = 0 if m.tie_embeddings else m.vocab_size * m.dim
    return m.vocab_size * m.dim + m.n_layers * block + m.dim + head


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
    from lctrain.validation import warnings_for

    d = derive(cfg, world_size)
    topo = Topology.from_config(cfg, world_size)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    head_dim = m.dim // m.n_heads
    bytes_act = 2 if t.dtype == "bf16" else 4
    n_params = param_count(m)
    local_params = n_params / (p.tp * p.pp)
    state_bytes = 16 * local_params / (d.dp * p.cp)  # fp32 weight + grad + 2 AdamW moments
    tokens = t.micro_batch * d.local_seq_len         # per cp rank
    seq_div = p.tp if (p.sp and p.tp > 1) else 1
    # blocks: the measured-exact float32 formula (lctrain.memory); bf16 tensors take half
    act_layer = activation_formula(cfg, world_size, t.micro_batch) * bytes_act / 4
    logits = tokens * (m.vocab_size / p.tp) * 4 * 2  # fp32 logits and their gradient
    act_bytes = act_layer * m.n_layers / p.pp + logits
    traffic = attention_traffic_per_layer(cfg, world_size) if p.cp > 1 else {}
    # Per block forward: 2 all-gathers + 2 reduce-scatters with SP, or 2 all-reduces without;
    # a ring all-reduce is a reduce-scatter plus an all-gather (DIGEST section 2), same bytes.
    tp_elems = 4 * (p.tp - 1) / p.tp * tokens * m.dim
    n = d.dp * p.cp
    fsdp_elems = 3 * (n - 1) / n * local_params if n > 1 else 0.0
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
            "activations_estimate": act_bytes / GIB,
            "total_estimate": (state_bytes + act_bytes) / GIB,
        },
        "traffic_elements_per_rank": {
            **traffic,
            "tp_per_layer_fwd": tp_elems,
            "fsdp_per_step": fsdp_elems,
        },
        "groups": {name: {"axes": list(GROUPS[name][0]), "size": topo.group_size(name),
                          "carries": GROUPS[name][1]} for name in GROUPS},
        "ranks": [{"rank": r, "node": r // gpus, **topo.coords(r)} for r in range(world_size)],
        "notes": notes,
    }


def render_text(plan: dict, max_rows: int) -> str:
    lay = plan["layout"]
    lines = [
        f"world size {plan['world_size']}: " + " x ".join(f"{a}={lay[a]}" for a in AXES)
        + f"  (cp={lay['cp']}, sp={lay['sp']})",
        f"attention {plan['attention']}, load balance {plan['load_balance']}, grad accumulation "
        f"{plan['grad_accum']}, {plan['tokens_per_step']:,} tokens/step",
        "", "per-rank shapes:",
        *(f"  {k}: {v}" for k, v in plan["shapes"].items()),
        "", f"memory per rank (GiB, estimate; activation checkpointing "
            f"{plan['activation_checkpointing']}):",
        *(f"  {k}: {v:,.3f}" for k, v in plan["memory_gib"].items()),
        "", "traffic per rank (elements sent):",
        *(f"  {k}: {v:,.0f}" for k, v in plan["traffic_elements_per_rank"].items()),
        "", "groups:",
        *(f"  {n:<11} size {g['size']:<4} axes {'x'.join(g['axes']):<25} {g['carries']}"
          for n, g in plan["groups"].items()),
        "", "ranks:", "  " + " ".join(f"{h:>10}" for h in ("rank", "node", *AXES)),
    ]
    for row in plan["ranks"][:max_rows]:
        lines.append("  " + " ".join(f"{row[h]:>10}" for h in ("rank", "node", *AXES)))
    if len(plan["ranks"]) > max_rows:
        lines.append(f"  ... {len(plan['ranks']) - max_rows} more (plan.max_rank_rows, or --json)")
    if plan["notes"]:
        lines += ["", "notes:", *(f"  - {n}" for n in plan["notes"])]
    return "\n".join(lines)


def plan_world_size(cfg: LctrainConfig) -> int:
    if cfg.launch.nproc is not None:
        return cfg.launch.nproc
    return cfg.slurm.nodes * cfg.slurm.gpus_per_node


def run_plan(composed, as_json: bool) -> int:
    from lctrain.cli import fail_config
    from lctrain.validation import validate

    cfg: LctrainConfig = composed.cfg
    world = plan_world_size(cfg)
    problems = validate(cfg, world)
    if problems:
        fail_config(problems)
    plan = build_plan(cfg, world)
    if as_json or cfg.plan.format == "json":
        json.dump(plan, sys.stdout, indent=1)
        print()
    else:
        print(render_text(plan, cfg.plan.max_rank_rows))
    return 0
