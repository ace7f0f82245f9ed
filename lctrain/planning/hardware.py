"""What the step-time model (`lctrain.planning.timing`) knows of the machine: a `Hardware`, from
plan.* (a GPU cluster's datasheet numbers and efficiencies) or, for a CPU run, from the
calibration file `lctrain plan --calibrate` writes (this machine's measured matmul rate, gloo
bandwidth and latency, and the fixed costs of lctrain's training step). docs/parallelism.md §15.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from lctrain.config import LctrainConfig
from lctrain.config.derived import plans_gpu_nodes, slurm_ranks_per_node


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What one rank computes and sends per second, and what it pays regardless of size."""

    device_tflops: float
    """Peak TFLOP/s of one rank (a CPU: the calibrated fp32 matmul rate of one process)."""
    matmul_efficiency: float = 1.0
    """Fraction of the peak the linear layers reach."""
    attention_efficiency: float = 1.0
    """Fraction of the peak the attention kernel reaches."""
    intra_node_gbps: float
    """GB/s one rank sends to ranks on its node."""
    inter_node_gbps: float
    """GB/s one rank sends to ranks on other nodes."""
    ranks_per_node: int = 0
    """Ranks sharing a node (0: all ranks on one node)."""
    cores: int = 0
    """CPU cores the ranks share (a calibrated CPU): more ranks than cores divides each rank's
    rate, bandwidth and fixed costs by ranks / cores. 0: every rank has its own device."""
    latency_s: float = 0.0
    """Seconds of one collective call besides its bytes (0 for plan.*: a GPU step at long
    context makes a few thousand calls of ~10 us, under 1% of it)."""
    fixed_costs: dict[str, tuple[float, float]] = field(default_factory=dict)
    """(seconds per block and micro-batch, seconds per micro-batch besides the blocks) a step
    costs beyond its FLOPs, bytes and calls, by `timing.CALIBRATED_LAYOUTS` name (a CPU: Python,
    dispatch, memory-bound elementwise kernels, FSDP's hooks, DTensor, the attention
    algorithm's loop). Empty for plan.*: on a GPU at long context they are far below the
    kernels' time."""
    pcie_gbps: float = 0.0
    """GB/s one rank copies between host and device (0: the host is the device, a CPU run:
    offloading copies nothing)."""
    host_adam_gparams_per_s: float = 0.0
    """Billions of parameters per second one rank's host AdamW step updates (0: not known,
    the host step is not counted)."""
    source: str = "plan.*"

    def flops_per_s(self, efficiency: float) -> float:
        return self.device_tflops * 1e12 * efficiency


def hardware_from_plan(cfg: LctrainConfig) -> Hardware:
    """The plan.* keys, ranks per node from slurm.* (`slurm_ranks_per_node`)."""
    p = cfg.plan
    return Hardware(device_tflops=p.device_tflops, matmul_efficiency=p.matmul_efficiency,
                    attention_efficiency=p.attention_efficiency,
                    intra_node_gbps=p.intra_node_gbps, inter_node_gbps=p.inter_node_gbps,
                    ranks_per_node=slurm_ranks_per_node(cfg), pcie_gbps=p.pcie_gbps,
                    host_adam_gparams_per_s=p.host_adam_gparams_per_s)


def calibration_path(cfg: LctrainConfig) -> Path:
    return Path(os.path.expanduser(cfg.plan.calibration))


def hardware_from_calibration(data: dict, source: str = "calibration") -> Hardware:
    """A CPU whose ranks all sit on this machine: the measured matmul rate (efficiency 1 for
    both kernel classes: the rate is already what a matmul reaches), the gloo bandwidth and
    latency between two local ranks for every group, the step's fixed costs, and the host
    AdamW rate (no host<->device copies: the host is the device)."""
    return Hardware(device_tflops=data["matmul_tflops"], intra_node_gbps=data["gloo_gbps"],
                    inter_node_gbps=data["gloo_gbps"], cores=data["cores"],
                    latency_s=data.get("latency_s", 0.0),
                    fixed_costs={name: tuple(v) for name, v in data.get("fixed_costs", {}).items()},
                    host_adam_gparams_per_s=data.get("host_adam_gparams_per_s", 0.0),
                    source=source)


def hardware_for(cfg: LctrainConfig, gpu_available: bool) -> Hardware:
    """The calibration file for a CPU run (train.device=cpu, or auto without a GPU) when it
    exists, else plan.*."""
    cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not gpu_available)
    path = calibration_path(cfg)
    if cpu and path.is_file():
        return hardware_from_calibration(json.loads(path.read_text()), str(path))
    return hardware_from_plan(cfg)


def plan_hardware(cfg: LctrainConfig) -> tuple[Hardware, list[str]]:
    """The step-time model's hardware for the run this config describes: GPUs when
    slurm.gpus_per_node > 0 (plan.*), else this CPU's calibration (plan.calibration); a note
    when a CPU run has no calibration."""
    gpu = plans_gpu_nodes(cfg)
    hw = hardware_for(cfg, gpu_available=gpu)
    if not gpu and hw.source == "plan.*":
        return hw, [f"a CPU run, but no calibration at {calibration_path(cfg)}: the step time "
                    "uses plan.* (a GPU's numbers); run `lctrain plan --calibrate` first"]
    return hw, []
