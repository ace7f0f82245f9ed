"""Predicted time of one optimizer step: compute from the model FLOPs and a FLOP rate, traffic
per group from `lctrain.planning.traffic` over the bandwidth of where the group's ranks sit,
ring attention's P2P hidden behind the attention it overlaps, and the pipeline bubble
(docs/parallelism.md §15). Pure arithmetic on a config and a `Hardware`: no process or device.

`Hardware` comes from plan.* (a GPU cluster's datasheet numbers and efficiencies) or, for a CPU
run, from the calibration file `lctrain plan --calibrate` writes (this machine's measured matmul
rate and gloo bandwidth).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lctrain.config import LctrainConfig, derive
from lctrain.config.derived import slurm_ranks_per_node
from lctrain.layout.stages import bubble_fraction, layer_costs, split_layers, stages_of
from lctrain.layout.topology import Topology
from lctrain.planning.flops import train_flops_per_step
from lctrain.planning.traffic import attention_traffic, step_traffic_bytes


@dataclass(frozen=True)
class Hardware:
    """What one rank computes and sends per second."""

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
    rate by ranks / cores. 0: every rank has its own device."""
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
    both kernel classes: the rate is already what a matmul reaches) and the gloo bandwidth
    between two local ranks for every group."""
    gbps = data["gloo_gbps"]
    return Hardware(data["matmul_tflops"], 1.0, 1.0, gbps, gbps, 0, data["cores"], source)


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
    """Model FLOPs of the step over the rank's rate (matmul and attention at their efficiencies)."""
    comm_s: dict[str, float]
    """Per group: bytes the rank sends / the group's bandwidth (intra- or inter-node)."""
    exposed_comm_s: float
    """Communication not hidden behind compute: all but ring P2P, plus what of it outlasts
    the attention it overlaps."""
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


def cp_step_bytes(cfg: LctrainConfig, world_size: int) -> dict[str, float]:
    """Bytes one rank sends per step in the context-parallel attention, by group: "cp_ring"
    (ring P2P), "cp_ulysses" (all-to-all), "cp" (all-gather KV); the blocks of the pipeline
    rank with the most."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    d = derive(cfg, world_size)
    if p.cp == 1:
        return {}
    head_dim = m.dim // m.n_heads
    dq = m.n_heads // p.tp * head_dim
    dkv = m.n_kv_heads // p.tp * d.kv_replication * head_dim
    stages = split_layers(cfg)
    blocks = max(sum(len(stages[s]) for s in stages_of(cfg, r)) for r in range(p.pp))
    scale = blocks * d.grad_accum * (2 if t.dtype == "bf16" else 4)

    def both(x: dict[str, float]) -> float:
        return scale * (x["forward"] + x["backward"])

    if p.attention == "allgather":
        return {"cp": both(attention_traffic("allgather", t.seq_len, dq, dkv, p.cp, 1,
                                             t.micro_batch))}
    total = both(attention_traffic(p.attention, t.seq_len, dq, dkv, p.cp, d.cp_ulysses,
                                   t.micro_batch))
    # the ring's share: a plain ring over R ranks of the heads this rank holds after the a2a
    ring = both(attention_traffic("ring", t.seq_len, dq, dkv / d.cp_ulysses, d.cp_ring, 1,
                                  t.micro_batch))
    out = {"cp_ring": ring, "cp_ulysses": total - ring}
    return {k: v for k, v in out.items() if v > 0}


def compute_seconds(cfg: LctrainConfig, world_size: int, hw: Hardware) -> tuple[float, float]:
    """(matmul seconds, attention seconds) of one rank's share of the step's model FLOPs."""
    embedding, blocks, output = layer_costs(cfg.model, cfg.train.seq_len)
    attention_per_token = 3 * 2 * cfg.train.seq_len * cfg.model.dim * len(blocks)
    tokens = derive(cfg, world_size).tokens_per_step / world_size
    rate = hw.device_tflops * 1e12
    if hw.cores and world_size > hw.cores:
        rate *= hw.cores / world_size
    matmul = (embedding + sum(blocks) + output - attention_per_token) * tokens
    return (matmul / (rate * hw.matmul_efficiency),
            attention_per_token * tokens / (rate * hw.attention_efficiency))


def predict_step_time(cfg: LctrainConfig, world_size: int, hw: Hardware) -> StepTime:
    """The step-time model of docs/parallelism.md §15."""
    topology = Topology.from_config(cfg, world_size)
    matmul_s, attention_s = compute_seconds(cfg, world_size, hw)
    nbytes = {**step_traffic_bytes(cfg, world_size), **cp_step_bytes(cfg, world_size)}
    comm = {g: b / (group_bandwidth_gbps(topology, "dp_cp" if g == "dp" else g, hw) * 1e9)
            for g, b in nbytes.items()}
    ring = comm.get("cp_ring", 0.0)
    r = topology.cp_ring
    # each of the R - 1 transfers runs behind the attention of one of the R blocks
    exposed = sum(comm.values()) - ring + max(0.0, ring - attention_s * (r - 1) / r)
    busy = matmul_s + attention_s + exposed
    p = cfg.parallel
    fraction = bubble_fraction(p.pp_schedule, p.pp, derive(cfg, world_size).grad_accum,
                               p.pp_virtual_stages)
    bubble = busy * fraction / (1 - fraction)
    total = busy + bubble
    tokens = derive(cfg, world_size).tokens_per_step
    flops = train_flops_per_step(cfg, tokens)
    return StepTime(compute_s=matmul_s + attention_s, comm_s=comm, exposed_comm_s=exposed,
                    bubble_s=bubble, total_s=total,
                    tokens_per_s_per_rank=tokens / total / world_size,
                    mfu=flops / (total * world_size * hw.device_tflops * 1e12))
