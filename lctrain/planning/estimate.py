"""The plan of a validated layout for a world size: per-rank shapes, memory and traffic, as plain
data (`lctrain plan` prints it as text or JSON).

No process, device or process group is created. Traffic: the formulas of
`lctrain.planning.traffic` (elements sent per rank). Memory (`lctrain.planning.state`,
`.activations`, `.schedule`): fp32 master weights, gradients and AdamW moments (sharded over
dp x cp by FSDP, replicated by DDP), FSDP's gathered weights, the activations the forward keeps (blocks and head, exact against
measurement in fp32 and bf16; on the host with train.offload_activations) and the backward's
working set (an estimate). Under pipeline parallelism every pipeline rank has its own figures
(its stages, the micro-batches they keep in flight, its receive buffers); the headline is the
rank with the largest total, and "pipeline" holds them stage by stage. "memory_per_rank"
itemises that rank's bytes, adds a stated allocator allowance and gives a FITS / DOES NOT FIT
verdict against plan.gpu_memory_gib; "predicted" holds the traffic keys `lctrain train` logs,
byte for byte (docs/parallelism.md §16).
"""

from __future__ import annotations

from lctrain.config import LctrainConfig, derive
from lctrain.config.derived import (
    load_balance_of,
    slurm_ranks_per_node,
)
from lctrain.config.model_size import active_param_count, param_count
from lctrain.config.schema import SLIDING
from lctrain.config.validation import warnings_for
from lctrain.layout.halo import unit_halo
from lctrain.layout.stages import bubble_fraction, split_layers, stages_of
from lctrain.layout.topology import AXES, GROUPS, Topology
from lctrain.planning.activations import attention_buffer_bytes, working_bytes
from lctrain.planning.cp_costs import cp_costs
from lctrain.planning.documents import load_balance_table
from lctrain.planning.schedule import (
    accumulating_share,
    backward_stages,
    in_flight_moments,
    pipeline_buffer_bytes,
    pipeline_send_bytes,
    stage_activation_bytes,
)
from lctrain.planning.state import (
    ALLOCATOR_FIXED_GIB,
    ALLOCATOR_FRACTION,
    accumulated_grad_bytes,
    allocator_allowance,
    gathered_weight_bytes,
    host_state_parts,
    stage_params,
    state_parts,
)
from lctrain.planning.traffic import (
    attention_traffic,
    cp_step_bytes,
    data_parallel_traffic,
    ep_step_bytes,
    host_copy_bytes,
    layer_windows,
    linear_layers,
    linear_transfers,
    step_traffic_bytes,
    tp_block_traffic,
)

GIB = 2**30


def attention_traffic_per_layer(cfg: LctrainConfig, world_size: int) -> dict[str, float]:
    """Elements sent per rank by one layer's attention (micro-batch of sequences); a window
    layer's too, when the model has them (rank 0's halo exchange, §25)."""
    d = derive(cfg, world_size)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out = {}
    for window in layer_windows(cfg, range(m.n_layers)):
        halo = None if window is None else unit_halo(t.seq_len, p.cp, window,
                                                     load_balance_of(cfg), d.cp_ulysses)
        sent = attention_traffic(p.attention, t.seq_len, m.q_dim // p.tp,
                                 m.kv_dim // p.tp * d.kv_replication, p.cp, d.cp_ulysses,
                                 batch=t.micro_batch, halo=halo)
        kind = p.attention if window is None else f"{p.attention}_window{window}"
        out |= {f"{kind}_per_layer_fwd": sent["forward"],
                f"{kind}_per_layer_bwd": sent["backward"]}
    if linear_layers(cfg, range(m.n_layers)):  # a Gated DeltaNet layer, both ways (§31)
        for how in ("state", "heads"):
            for x in linear_transfers(cfg, how):
                key = f"linear_{how}_per_layer_{x.direction}"
                out[key] = out.get(key, 0) + x.elements * t.micro_batch
    return out


def predicted_traffic(cfg: LctrainConfig, world_size: int) -> dict:
    """The traffic keys `lctrain train` logs for this layout, predicted (bytes per rank per
    optimizer step): `cp_bytes_sent` (always) and `traffic/cp` (cp > 1), rank 0's (the rank
    that logs); for groups of more than one rank `traffic/tp`, `traffic/pp`, `traffic/dp`
    (`step_traffic_bytes`); `traffic/ep` under expert parallelism (`ep_step_bytes`, uniform
    routing); "cp_collectives", `cp_step_bytes`' breakdown, and under pipelining
    "cp_first_step_extra":
    what the first step sends besides, in the forward on placeholders by which the schedule
    learns the stages' shapes (one micro-batch through the rank's stages)."""
    cp = cp_step_bytes(cfg, world_size)
    out: dict = {"cp_bytes_sent": sum(cp.values(), 0.0)}  # logged at every cp, 0 at cp = 1
    if cp:
        out["traffic/cp"] = out["cp_bytes_sent"]
    out |= {f"traffic/{g}": v for g, v in step_traffic_bytes(cfg, world_size).items()}
    if cfg.parallel.ep > 1:  # measured by the run (its routing); planned at uniform routing
        out["traffic/ep"] = ep_step_bytes(cfg, world_size)
    if cp:
        out["cp_collectives"] = cp
    if cp and cfg.parallel.pp > 1:  # torch's schedule learns the stages' shapes by a forward
        accum = derive(cfg, world_size).grad_accum
        out["cp_first_step_extra"] = sum(v for k, v in cp.items() if k.endswith("_fwd")) / accum
    return out


def rank_memory(cfg: LctrainConfig, world_size: int, pp_rank: int) -> dict:
    """Memory of one rank of pipeline rank `pp_rank`: "itemised" (`itemised_memory`: its device
    bytes item by item, the allocator allowance, the one total and the verdict), and for each of
    its stages (`rank_stages` order) the micro-batches in flight at the rank's peak and the
    activation bytes they keep."""
    p, t = cfg.parallel, cfg.train
    stages = stages_of(cfg, pp_rank)
    per_micro_batch = [stage_activation_bytes(cfg, world_size, t.micro_batch, s) for s in stages]
    moments = in_flight_moments(p.pp_schedule, p.pp, derive(cfg, world_size).grad_accum,
                                p.pp_virtual_stages, pp_rank)
    # the rank peaks at the moment whose activations on the device, held sends and
    # accumulated gradients are the most bytes
    sends = (pipeline_send_bytes(cfg, world_size, t.micro_batch, pp_rank) if p.pp > 1
             else [0.0] * len(moments))
    accumulated = accumulated_grad_bytes(cfg, world_size, pp_rank)
    share = accumulating_share(cfg, world_size, pp_rank)
    on_device = 0.0 if t.offload_activations else 1.0
    # the backward working set: the loss head's (on the rank of the last stage) only at the
    # moments whose next backward is the last stage's, when the schedule tells
    last = len(split_layers(cfg)) - 1
    loss_head = last in stages
    next_backward = backward_stages(p.pp_schedule, p.pp, derive(cfg, world_size).grad_accum,
                                    p.pp_virtual_stages, pp_rank)
    block, head = (working_bytes(cfg, world_size, t.micro_batch, with_head)
                   for with_head in (False, loss_head))
    working = [head if j is None or stages[j] == last else block for j in next_backward]
    peak = max(range(len(moments)), key=lambda i: sends[i] + accumulated * share[i] + working[i]
               + on_device * sum(c * b for c, b in zip(moments[i], per_micro_batch)))
    in_flight = moments[peak]
    activations = [n * b for n, b in zip(in_flight, per_micro_batch)]
    kept = sum(activations)
    on_host = kept if t.offload_activations else 0.0
    parts = {
        "fsdp_gathered_weights": gathered_weight_bytes(cfg, world_size, pp_rank),
        "accumulated_gradients": accumulated * share[peak],
        "activations_kept": kept - on_host,
        "activations_on_host": on_host,
        "backward_working_set": working[peak],
    }
    if p.pp > 1:
        parts["pipeline_buffers"] = (  # received, and sent but not yet waited for
            pipeline_buffer_bytes(cfg, world_size, t.micro_batch, pp_rank) + sends[peak])
    return {"stages": stages, "in_flight": list(in_flight), "activations": activations,
            "itemised": itemised_memory(cfg, world_size, pp_rank, parts)}


def itemised_memory(cfg: LctrainConfig, world_size: int, pp_rank: int, parts: dict) -> dict:
    """One rank's device bytes item by item (`rank_memory`'s parts, the state split into
    weights, gradients and optimizer state, plus `attention_buffer_bytes`), the allocator
    allowance (`allocator_allowance`), the total (the modelled bytes and the allowance: the one
    total the plan gives), and the verdict against plan.gpu_memory_gib: FITS when the total is at
    most that many GiB."""
    items = state_parts(cfg, world_size, pp_rank) | {
        k: v for k, v in parts.items() if k != "activations_on_host"}
    items["attention_buffers"] = attention_buffer_bytes(cfg, world_size, cfg.train.micro_batch)
    modelled = sum(items.values())
    allowance = allocator_allowance(modelled)
    total = modelled + allowance
    capacity = cfg.plan.gpu_memory_gib * GIB
    return {"bytes": items | {"modelled": modelled, "allocator_allowance": allowance,
                              "total": total},
            "activations_on_host_bytes": parts["activations_on_host"],
            "gpu_memory_gib": cfg.plan.gpu_memory_gib, "total_gib": total / GIB,
            "verdict": "FITS" if total <= capacity else "DOES NOT FIT",
            "host": host_memory(cfg, world_size, pp_rank, parts["activations_on_host"]),
            "notes": memory_notes(cfg)}


def host_memory(cfg: LctrainConfig, world_size: int, pp_rank: int, activations: float) -> dict:
    """What one rank keeps in host memory (the offloaded state, `host_state_parts`, and the
    offloaded activations), what the node's ranks keep together, the verdict against
    plan.host_memory_gib, and the bytes the rank copies between host and device per step
    (`host_copy_bytes`)."""
    items = host_state_parts(cfg, world_size, pp_rank) | {"activations": activations}
    per_rank = sum(items.values())
    ranks_per_node = min(slurm_ranks_per_node(cfg) or world_size, world_size)
    per_node = per_rank * ranks_per_node
    return {"bytes_per_rank": items | {"total": per_rank}, "ranks_per_node": ranks_per_node,
            "per_node_gib": per_node / GIB, "host_memory_gib": cfg.plan.host_memory_gib,
            "verdict": "FITS" if per_node <= cfg.plan.host_memory_gib * GIB else "DOES NOT FIT",
            "copies_per_step_bytes": host_copy_bytes(cfg, world_size, pp_rank)}


def pipeline_table(cfg: LctrainConfig, world_size: int, ranks: list[dict]) -> dict:
    """The plan's "pipeline": schedule, micro-batches, bubble, and one row per stage."""
    p = cfg.parallel
    m = derive(cfg, world_size).grad_accum
    layers = split_layers(cfg)
    rows = []
    for pp_rank, mem in enumerate(ranks):
        for stage, n, act in zip(mem["stages"], mem["in_flight"], mem["activations"]):
            rows.append({"stage": stage, "pp_rank": pp_rank,
                         "layers": [layers[stage][0], layers[stage][-1]],
                         "embedding": stage == 0, "output": stage == len(layers) - 1,
                         "params": stage_params(cfg, stage), "micro_batches_in_flight": n,
                         "activations_gib": act / GIB,
                         "rank_total_gib": mem["itemised"]["total_gib"]})
    return {"schedule": p.pp_schedule, "stages_per_rank": len(ranks[0]["stages"]),
            "micro_batches": m,
            "bubble_fraction": bubble_fraction(p.pp_schedule, p.pp, m, p.pp_virtual_stages),
            "largest_pp_rank": max(range(p.pp),
                                   key=lambda r: ranks[r]["itemised"]["total_gib"]),
            "stages": sorted(rows, key=lambda row: row["stage"])}


def build_plan(cfg: LctrainConfig, world_size: int) -> dict:
    """Everything `lctrain plan` reports, as plain data (assumes `validate` passed)."""
    d = derive(cfg, world_size)
    topo = Topology.from_config(cfg, world_size)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    head_dim = m.d_head
    n_params = param_count(m)
    tokens = t.micro_batch * d.local_seq_len         # per cp rank
    seq_div = p.tp if (p.sp and p.tp > 1) else 1
    ranks = [rank_memory(cfg, world_size, r) for r in range(p.pp)]
    worst = max(ranks, key=lambda mem: mem["itemised"]["total_gib"])
    dp_traffic = max(  # of the pipeline rank that sends the most
        data_parallel_traffic(cfg, world_size, r, d.grad_accum) for r in range(p.pp))
    traffic = attention_traffic_per_layer(cfg, world_size) if p.cp > 1 else {}
    notes = list(warnings_for(cfg))
    if d.kv_replication > 1:
        notes.append(f"KV heads are replicated x{d.kv_replication} before the Ulysses all-to-all "
                     f"({m.n_kv_heads // p.tp} KV heads per TP rank, Ulysses degree "
                     f"{d.cp_ulysses})")
    per_node = slurm_ranks_per_node(cfg) or world_size  # (0: ranks that split unevenly)
    for name in ("tp", "cp_ulysses"):
        if per_node and topo.group_size(name) > 1 and any(len({r // per_node for r in g}) > 1
                                                          for g in topo.groups(name)):
            notes.append(f"{name} groups span nodes ({per_node} ranks per node); keep "
                         f"tp x cp_ulysses <= {per_node} for intra-node links")
    covering = m.sliding_window is not None and m.sliding_window >= t.seq_len and any(
        m.layer_type(i) == SLIDING for i in range(m.n_layers))
    if covering:
        notes.append(f"model.sliding_window={m.sliding_window} covers train.seq_len="
                     f"{t.seq_len}: the sliding-window layers attend over the whole sequence, "
                     "so every layer counts as full")
    if p.dp_engine == "deepspeed":
        notes.append(f"parallel.dp_engine=deepspeed: weights, gradients and optimizer_state "
                     f"count ZeRO-{cfg.deepspeed.zero_stage}'s shards on the device (offloaded "
                     "parts excluded); DeepSpeed's step traffic and buffers are not modelled")
    if p.pp > 1 and worst["itemised"]["bytes"]["fsdp_gathered_weights"]:
        notes.append("under pipelining FSDP keeps a stage's weights gathered from its backward "
                     "to its next forward: fsdp_gathered_weights counts all of a rank's stages")
    plan = {
        "world_size": world_size,
        "layout": {a: getattr(topo, a) for a in AXES} | {"cp": p.cp, "sp": p.sp},
        "attention": p.attention if p.cp > 1 else "local",
        "load_balance": load_balance_of(cfg) if p.cp > 1 else "none",
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
            "layers_per_stage": [len(layers) for layers in split_layers(cfg)],
            "layers_by_window": {("full" if w is None else f"window {w}"): n for w, n in
                                 layer_windows(cfg, range(m.n_layers)).items()}
            | ({"linear": linear} if (linear := linear_layers(cfg, range(m.n_layers))) else {}),
            **({"experts [MoE layers, experts per rank of E, token rows per rank]":
                [len(m.moe_layer_ids), m.n_experts // p.ep,
                 t.micro_batch * t.seq_len // (p.cp * seq_div) * m.experts_per_token]}
               if m.n_experts else {}),
        },
        "params_billion": n_params / 1e9,
        **({"active_params_billion": active_param_count(m) / 1e9} if m.n_experts else {}),
        "memory_gib": {k: v / GIB for k, v in worst["itemised"]["bytes"].items()},
        "memory_per_rank": worst["itemised"],
        "predicted": predicted_traffic(cfg, world_size),
        "traffic_elements_per_rank": {
            **traffic,
            "tp_per_layer_fwd": tp_block_traffic(tokens, m.dim, p.tp),
            **({} if p.dp_engine == "deepspeed" else {
                f"{p.dp_engine}_per_step": dp_traffic[0],
                f"{p.dp_engine}_bytes_per_step": dp_traffic[1]}),
        },
        "groups": {name: {"axes": list(GROUPS[name][0]), "size": topo.group_size(name),
                          "carries": GROUPS[name][1]} for name in GROUPS},
        "ranks": [{"rank": r, "node": r // per_node, **topo.coords(r)}
                  for r in range(world_size)],
        "notes": notes,
    }
    if p.pp > 1:
        plan["pipeline"] = pipeline_table(cfg, world_size, ranks)
    balances = load_balance_table(cfg)
    if balances:
        plan["packed_documents"] = balances
    return plan


def memory_notes(cfg: LctrainConfig) -> list[str]:
    """What memory_per_rank counts: the allocator rule, where the logits and loss buffers are,
    and what is not modelled."""
    notes = [f"allocator_allowance = {ALLOCATOR_FRACTION:.0%} of the modelled bytes + "
             f"{ALLOCATOR_FIXED_GIB:g} GiB (caching allocator, CUDA context, NCCL and kernel "
             "workspaces); the verdict compares the total with plan.gpu_memory_gib",
             "logits and loss buffers: in activations_kept (the log-softmax) and "
             "backward_working_set (the larger of one block's backward and the loss head's)"]
    unmodelled = cp_costs(cfg.parallel.attention).memory.unmodelled
    if cfg.parallel.cp > 1 and unmodelled:
        notes.append(f"not modelled: {unmodelled}")
    if cfg.parallel.dp_engine == "deepspeed":
        notes.append("not modelled: DeepSpeed's buckets and communication buffers")
    return notes
