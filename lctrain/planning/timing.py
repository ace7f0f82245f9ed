"""Predicted time of one optimizer step: compute from the model FLOPs (and what activation
checkpointing recomputes) over a FLOP rate, traffic per group over the bandwidth of where the
group's ranks sit plus a latency per collective call, ring attention's P2P hidden behind the
attention it overlaps, fixed costs per block and per step, and the pipeline bubble
(docs/parallelism.md §15). Pure arithmetic on a config and a `Hardware`: no process or device.

`Hardware` comes from plan.* (a GPU cluster's datasheet numbers and efficiencies) or, for a CPU
run, from the calibration file `lctrain plan --calibrate` writes (this machine's measured matmul
rate, gloo bandwidth and latency, and the fixed costs of lctrain's training step).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from lctrain.config import LctrainConfig, derive
from lctrain.config.cp_algorithms import CP_ALGORITHMS, cp_algorithm
from lctrain.config.derived import slurm_ranks_per_node
from lctrain.layout.stages import bubble_fraction, layer_costs, split_layers, stages_of
from lctrain.layout.topology import Topology
from lctrain.planning.flops import train_flops_per_step
from lctrain.planning.memory import local_params
from lctrain.planning.traffic import (
    cp_step_bytes,
    cp_step_groups,
    cp_transfers,
    dp_step_bytes,
    step_traffic_bytes,
)


@dataclass(frozen=True)
class Hardware:
    """What one rank computes and sends per second, and what it pays regardless of size."""

    device_tflops: float
    """Peak TFLOP/s of one rank (a CPU: the calibrated fp32 matmul rate of one process)."""
    matmul_efficiency: float
    """Fraction of the peak the linear layers reach."""
    attention_efficiency: float
    """Fraction of the peak the attention kernel reaches."""
    intra_node_gbps: float
    """GB/s one rank sends to ranks on its node."""
    inter_node_gbps: float
    """GB/s one rank sends to ranks on other nodes."""
    ranks_per_node: int
    """Ranks sharing a node (0: all ranks on one node)."""
    cores: int = 0
    """CPU cores the ranks share (a calibrated CPU): more ranks than cores divides each rank's
    rate, bandwidth and fixed costs by ranks / cores. 0: every rank has its own device."""
    latency_s: float = 0.0
    """Seconds of one collective call besides its bytes (0 for plan.*: a GPU step at long
    context makes a few thousand calls of ~10 us, under 1% of it)."""
    fixed_costs: dict[str, tuple[float, float]] = field(default_factory=dict)
    """(seconds per block and micro-batch, seconds per micro-batch besides the blocks) a step
    costs beyond its FLOPs, bytes and calls, by `FIXED_COST_LAYOUTS` name: "base" for every layout, the others the
    extra a layout with that feature pays (a CPU: Python, dispatch, memory-bound elementwise
    kernels, FSDP's hooks, DTensor, the attention algorithm's loop). Empty for plan.*: on a
    GPU at long context they are far below the kernels' time."""
    source: str = "plan.*"


def hardware_from_plan(cfg: LctrainConfig) -> Hardware:
    """The plan.* keys, ranks per node from slurm.* (`slurm_ranks_per_node`)."""
    p = cfg.plan
    return Hardware(p.device_tflops, p.matmul_efficiency, p.attention_efficiency,
                    p.intra_node_gbps, p.inter_node_gbps, slurm_ranks_per_node(cfg))


def calibration_path(cfg: LctrainConfig) -> Path:
    return Path(os.path.expanduser(cfg.plan.calibration))


def hardware_from_calibration(data: dict, source: str = "calibration") -> Hardware:
    """A CPU whose ranks all sit on this machine: the measured matmul rate (efficiency 1 for
    both kernel classes: the rate is already what a matmul reaches), the gloo bandwidth and
    latency between two local ranks for every group, and the step's fixed costs."""
    gbps = data["gloo_gbps"]
    costs = {name: tuple(v) for name, v in data.get("fixed_costs", {}).items()}
    return Hardware(data["matmul_tflops"], 1.0, 1.0, gbps, gbps, 0, data["cores"],
                    data.get("latency_s", 0.0), costs, source)


def hardware_for(cfg: LctrainConfig, gpu_available: bool) -> Hardware:
    """The calibration file for a CPU run (train.device=cpu, or auto without a GPU) when it
    exists, else plan.*."""
    cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not gpu_available)
    path = calibration_path(cfg)
    if cpu and path.is_file():
        return hardware_from_calibration(json.loads(path.read_text()), str(path))
    return hardware_from_plan(cfg)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the busiest rank."""

    compute_s: float
    """Model FLOPs of the step, and the forward FLOPs checkpointing recomputes, over the rank's
    rate (matmul and attention at their efficiencies)."""
    recompute_s: float
    """The part of compute_s that activation checkpointing adds."""
    comm_s: dict[str, float]
    """Per group: bytes the rank sends / the group's bandwidth (intra- or inter-node), plus its
    collective calls x the latency."""
    exposed_comm_s: float
    """Communication not hidden behind compute: all but ring P2P, plus what of it outlasts
    the attention it overlaps."""
    overhead_s: float
    """Fixed costs per block and micro-batch, and per micro-batch (`Hardware.fixed_costs`)."""
    bubble_s: float
    """Pipeline idle time (pp > 1): bubble_fraction of the step."""
    total_s: float
    tokens_per_s_per_rank: float
    mfu: float
    """Model FLOPs / (total_s x ranks x device_tflops)."""


def group_bandwidth_gbps(topology: Topology, group: str, hw: Hardware) -> float:
    """Intra-node bandwidth when every instance of the group has all its ranks on one node
    (rank // ranks_per_node), else inter-node."""
    n = hw.ranks_per_node
    if n <= 0:
        return hw.intra_node_gbps
    intra = all(len({r // n for r in members}) == 1 for members in topology.groups(group))
    return hw.intra_node_gbps if intra else hw.inter_node_gbps


def cp_group_bytes(cfg: LctrainConfig, world_size: int) -> dict[str, float]:
    """Bytes one rank sends per step in the context-parallel attention, by the group each
    transfer names (`cp_step_groups`: "cp_ring" ring P2P, "cp_ulysses" all-to-all, "cp"
    all-gather KV): `cp_step_bytes` (recompute included) of the pipeline rank with the most."""
    groups = cp_step_groups(cfg, world_size)
    out: dict[str, float] = {}
    for r in range(cfg.parallel.pp):
        mine: dict[str, float] = {}
        for name, nbytes in cp_step_bytes(cfg, world_size, r).items():
            mine[groups[name]] = mine.get(groups[name], 0.0) + nbytes
        out = max(out, mine, key=lambda x: sum(x.values()))
    return out


def dp_bytes(cfg: LctrainConfig, world_size: int) -> float:
    """Bytes one rank sends per step over dp x cp: the logged formula where lctrain has one
    (`step_traffic_bytes`); under pipelining FSDP's weights gathered once per step (kept across
    micro-batches); DeepSpeed as the engine it resembles (ZeRO-3: FSDP's gathers in every
    micro-step; ZeRO-1/2: DDP's all-reduce volume as reduce-scatter + all-gather)."""
    p, d = cfg.parallel, derive(cfg, world_size)
    shards = d.dp * p.cp
    logged = step_traffic_bytes(cfg, world_size)
    if shards == 1 or "dp" in logged:
        return logged.get("dp", 0.0)
    compute = 2 if cfg.train.dtype == "bf16" else 4
    engine, accum = p.dp_engine, d.grad_accum
    if engine == "deepspeed":
        engine = "fsdp" if cfg.deepspeed.zero_stage == 3 else "ddp"
    if p.pp > 1:
        accum = 1
    return max(dp_step_bytes(engine, *local_params(cfg, r), shards, accum, compute)
               for r in range(p.pp))


def collective_calls(cfg: LctrainConfig, world_size: int) -> dict[str, float]:
    """Collective calls one rank makes per step, by group (those besides FSDP/DDP, whose calls
    the calibrated block overhead already holds): per block and micro-batch, TP's 4 forward and
    4 backward (all-gather / reduce-scatter with SP, all-reduce without: 2 and 2) and the
    recompute's 3 (1); the attention's transfers' calls (`Transfer.calls`: the ring's R - 1
    forward exchanges, 2 (R - 1) backward; the Ulysses all-to-alls, 4 each way; the all-gather
    of K/V and the reduce-scatter of their gradients, 2 each way), the forward's again when
    recomputed; the pipeline's send and receive of each micro-batch, forward and backward, per
    stage boundary the rank holds."""
    p, t, d = cfg.parallel, cfg.train, derive(cfg, world_size)
    stages, mine = split_layers(cfg), stages_of(cfg, 0)
    blocks = max(sum(len(stages[s]) for s in stages_of(cfg, r)) for r in range(p.pp))
    again = t.activation_checkpointing != "none"
    per_block: dict[str, float] = {}
    if p.tp > 1:
        per_block["tp"] = 8 + (3 if again else 0) if p.sp else 4 + (1 if again else 0)
    for x in cp_transfers(cfg, world_size):  # the forward's again when recomputed
        times = 2 if again and x.direction == "fwd" else 1
        per_block[x.group] = per_block.get(x.group, 0) + times * x.calls
    out = {g: n * blocks * d.grad_accum for g, n in per_block.items()}
    if p.pp > 1:
        out["pp"] = 4 * len(mine) * d.grad_accum
    return out


FIXED_COST_LAYOUTS: dict[str, dict] = {
    "single": {},
    "base": {"dp": 2},
    "tp": {"tp": 2, "sp": True, "dp": 1},
    **{a.name: {"cp": 2, "attention": a.name, "dp": 1} for a in CP_ALGORITHMS.entries()
       if a.timing.calibrated},
    "pp": {"pp": 2, "dp": 1},
    "ddp": {"dp": 2, "dp_engine": "ddp"},
    "selective": {"activation_checkpointing": "selective"},
    "full": {"activation_checkpointing": "full"},
}
"""The layouts whose fixed costs `lctrain plan --calibrate` measures (parallel.* overrides,
and train.activation_checkpointing): "single" one process, "base" 2-rank data parallelism
(FSDP), the others one feature each on 2 ranks (a context-parallel algorithm's when its
registry entry says `calibrated`), but the checkpointing modes: one process each (what they add
is work of the rank, the same beside any engine)."""
SINGLE_RANK_FEATURES = ("selective", "full")
"""Fixed-cost features measured against "single", not "base"."""
TRAIN_KEYS = ("activation_checkpointing",)
"""The keys of FIXED_COST_LAYOUTS that are train.* settings."""


def fixed_seconds(cfg: LctrainConfig, world_size: int, hw: Hardware) -> float:
    """The step's fixed costs on the busiest rank: per block and micro-batch, "base" plus the
    extra of each feature the layout uses (the attention's as its registry entry counts them,
    `TimingTerms.fixed_costs`: the ring's x (R - 1), its exchanges per block; DDP's
    against FSDP; a checkpointing mode's against one process without it),
    times the rank's blocks; per micro-batch besides the blocks (the embedding, the loss head,
    the loader, and the optimizer step's share), "base" plus the same extras; both times the
    rank's micro-steps."""
    if not hw.fixed_costs:
        return 0.0
    p, d, mode = cfg.parallel, derive(cfg, world_size), cfg.train.activation_checkpointing
    attention = (cp_algorithm(p.attention).timing.fixed_costs(d.cp_ring, d.cp_ulysses)
                 if p.cp > 1 else {})
    used = {"base": 1.0, "tp": float(p.tp > 1), "pp": float(p.pp > 1), **attention,
            "ddp": float(p.dp_engine == "ddp" and d.dp * p.cp > 1),
            "selective": float(mode == "selective"), "full": float(mode == "full")}
    base = "base" if world_size > 1 else "single"
    block, rest = hw.fixed_costs[base]
    for name, times in used.items():
        if name != "base" and times and name in hw.fixed_costs:
            ref = hw.fixed_costs["single" if name in SINGLE_RANK_FEATURES else base]
            block += times * (hw.fixed_costs[name][0] - ref[0])
            rest += times * (hw.fixed_costs[name][1] - ref[1])
    blocks = max(sum(len(split_layers(cfg)[s]) for s in stages_of(cfg, k)) for k in range(p.pp))
    return (max(0.0, block) * blocks + max(0.0, rest)) * d.grad_accum


def compute_seconds(cfg: LctrainConfig, world_size: int,
                    hw: Hardware) -> tuple[float, float, float]:
    """(matmul seconds, attention seconds, recompute seconds) of one rank's share of the step:
    the model FLOPs, and the forward FLOPs run again: by checkpointing (`full`: the blocks'
    forward; `selective` at cp > 1: the attention's forward; at cp = 1 it recomputes only
    elementwise work), by the tiled loss (the output layer) and the tiled MLP (its three
    matmuls)."""
    embedding, blocks, output = layer_costs(cfg.model, cfg.train.seq_len)
    attention_per_token = 3 * 2 * cfg.train.seq_len * cfg.model.dim * len(blocks)
    tokens = derive(cfg, world_size).tokens_per_step / world_size
    rate = hw.device_tflops * 1e12
    matmul = (embedding + sum(blocks) + output - attention_per_token) * tokens
    attention = attention_per_token * tokens
    t, m = cfg.train, cfg.model
    recompute = 0.0
    if t.activation_checkpointing == "full":
        recompute = ((sum(blocks) - attention_per_token) / (rate * hw.matmul_efficiency)
                     + attention_per_token / (rate * hw.attention_efficiency)) * tokens / 3
    elif t.activation_checkpointing == "selective" and cfg.parallel.cp > 1:
        recompute = attention / 3 / (rate * hw.attention_efficiency)
    # the tiled loss runs the output layer again in the backward, the tiled MLP its forward
    tiled = (output / 3 if t.loss_chunk else 0) + (
        2 * 3 * m.dim * m.ffn_dim * m.n_layers if t.mlp_chunk else 0)
    recompute += tiled * tokens / (rate * hw.matmul_efficiency)
    return (matmul / (rate * hw.matmul_efficiency),
            attention / (rate * hw.attention_efficiency), recompute)


def predict_step_time(cfg: LctrainConfig, world_size: int, hw: Hardware) -> StepTime:
    """The step-time model of docs/parallelism.md §15."""
    topology = Topology.from_config(cfg, world_size)
    d, p = derive(cfg, world_size), cfg.parallel
    # ranks sharing too few cores run everything (compute, gloo's copies, the fixed costs) on a
    # share of a core
    share = world_size / hw.cores if hw.cores and world_size > hw.cores else 1.0
    matmul_s, attention_s, recompute_s = (share * t for t in compute_seconds(cfg, world_size, hw))
    nbytes = {**step_traffic_bytes(cfg, world_size), **cp_group_bytes(cfg, world_size)}
    nbytes.pop("dp", None)
    if d.dp * p.cp > 1:
        nbytes["dp"] = dp_bytes(cfg, world_size)
    calls = collective_calls(cfg, world_size)
    comm = {g: share * (b / (group_bandwidth_gbps(topology, "dp_cp" if g == "dp" else g, hw)
                             * 1e9) + calls.get(g, 0) * hw.latency_s)
            for g, b in nbytes.items() if b > 0}
    ring = comm.get("cp_ring", 0.0)
    r = topology.cp_ring
    # each of the R - 1 transfers runs behind the attention of one of the R blocks
    exposed = sum(comm.values()) - ring + max(0.0, ring - attention_s * (r - 1) / r)
    overhead = share * fixed_seconds(cfg, world_size, hw)
    compute = matmul_s + attention_s + recompute_s
    busy = compute + exposed + overhead
    fraction = bubble_fraction(p.pp_schedule, p.pp, d.grad_accum, p.pp_virtual_stages)
    bubble = busy * fraction / (1 - fraction)
    total = busy + bubble
    flops = train_flops_per_step(cfg, d.tokens_per_step)
    return StepTime(compute_s=compute, recompute_s=recompute_s, comm_s=comm,
                    exposed_comm_s=exposed, overhead_s=overhead, bubble_s=bubble, total_s=total,
                    tokens_per_s_per_rank=d.tokens_per_step / total / world_size,
                    mfu=flops / (total * world_size * hw.device_tflops * 1e12))


def step_time_summary(cfg: LctrainConfig, world_size: int, hw: Hardware) -> dict:
    """`predict_step_time` as plain data for `lctrain plan`: its terms, tokens/s per rank and in
    all, MFU, and where the hardware numbers came from."""
    t = predict_step_time(cfg, world_size, hw)
    return {"hardware": hw.source, "total_s": t.total_s, "compute_s": t.compute_s,
            "recompute_s": t.recompute_s, "comm_s": t.comm_s,
            "exposed_comm_s": t.exposed_comm_s, "fixed_costs_s": t.overhead_s,
            "bubble_s": t.bubble_s, "tokens_per_s_per_rank": t.tokens_per_s_per_rank,
            "tokens_per_s": t.tokens_per_s_per_rank * world_size, "mfu": t.mfu}
