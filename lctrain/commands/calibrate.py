"""`lctrain plan --calibrate`: measure this machine's fp32 matmul rate, the gloo bandwidth and
latency between two local ranks, the host AdamW step's rate, and the fixed costs of lctrain's training step (per block and
micro-batch, per step: what the FLOPs and bytes leave out), print them, and write them to
plan.calibration, which the step-time model (`lctrain.planning.timing`) uses for CPU runs
(docs/parallelism.md §15)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lctrain.commands import CommandArgs
from lctrain.config import LctrainConfig, ModelConfig
from lctrain.config.derived import local_world_size
from lctrain.parallel.launch import run_ranks
from lctrain.planning.hardware import calibration_path, hardware_from_calibration
from lctrain.planning.timing import CALIBRATED_LAYOUTS, CalibratedLayout, predict_step_time
from lctrain.rundir.files import write_atomic
from lctrain.training.loop import train
from lctrain.training.metrics import measure_matmul_tflops


def _one_way_seconds(buf: torch.Tensor, repeats: int) -> float:
    """Seconds of one one-way send of `buf` to the other rank: the median of `repeats` round
    trips / 2 (the first round trip sets up the connection: not timed)."""
    peer = 1 - dist.get_rank()
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if i:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def measure_host_adam_gparams_per_s(params: int = 1 << 21, repeats: int = 5) -> float:
    """Billions of parameters per second torch's foreach AdamW updates in host memory (the
    step parallel.offload_state runs on the host): the median of `repeats` timed steps over
    8 tensors of `params` / 8 elements (the first step, which creates the state, not timed)."""
    weights = [torch.nn.Parameter(torch.randn(params // 8)) for _ in range(8)]
    for w in weights:
        w.grad = torch.randn_like(w)
    optimizer = torch.optim.AdamW(weights, lr=1e-4, foreach=True)
    optimizer.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return params / statistics.median(times) / 1e9


def _measure(nbytes: int, repeats: int) -> tuple[float, float, float, float]:
    """On each of 2 ranks at once (1 thread each, as training runs): (matmul TFLOP/s, seconds
    of one one-way send of `nbytes`, of a 4-byte one: the latency, host AdamW Gparams/s)."""
    rate = measure_matmul_tflops()
    return (rate, _one_way_seconds(torch.zeros(nbytes // 4), repeats),
            _one_way_seconds(torch.zeros(1), 4 * repeats), measure_host_adam_gparams_per_s())


MICRO_BATCHES = 4
"""Micro-batches of one sample per step and rank in a timed run."""


def overhead_config(model: ModelConfig, seq_len: int, layout: CalibratedLayout, layers: int,
                    steps: int = 6) -> LctrainConfig:
    """`model` at depth `layers` trained in `layout` on sequences of `seq_len`, fp32,
    MICRO_BATCHES micro-batches of 1 per step and rank."""
    cfg = LctrainConfig()
    cfg.model = dataclasses.replace(model, n_layers=layers)
    cfg.parallel = dataclasses.replace(cfg.parallel, **{"dp": 1, **layout.parallel})
    cfg.train = dataclasses.replace(cfg.train, **{
        "steps": steps, "seq_len": seq_len, "micro_batch": 1,
        "global_batch": MICRO_BATCHES * cfg.parallel.dp, "device": "cpu",
        "activation_checkpointing": "none", **layout.train})
    cfg.eval = dataclasses.replace(cfg.eval, every=0)
    cfg.logging = dataclasses.replace(cfg.logging, progress=False, log_every=steps)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=0)
    return cfg


def _quiet_train(cfg: LctrainConfig, run_dir: str) -> list[dict]:
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, run_dir)


def _measured_step_s(cfg: LctrainConfig, world: int) -> float:
    """The median step time of a training run (its log not printed), the first step (caches,
    FSDP's first gathers) left out."""
    with tempfile.TemporaryDirectory() as run_dir:
        history = run_ranks(_quiet_train, world, (cfg, run_dir), timeout_s=300)[0]
    return statistics.median(h["step_time"] for h in history[1:])


def fixed_costs(data: dict, model: ModelConfig, seq_len: int,
                layouts: tuple[CalibratedLayout, ...]) -> dict[str, list[float]]:
    """(seconds per block and micro-batch, seconds per micro-batch besides the blocks) each
    layout costs beyond its FLOPs, bytes and calls: two training runs that differ only in
    depth, each minus what the model predicts from the measured rate, bandwidth and latency;
    the depth's share is per block, the rest per micro-batch."""
    hw = hardware_from_calibration(data)
    out = {}
    for layout in layouts:
        rest = []
        for layers in layout.depths:
            cfg = overhead_config(model, seq_len, layout, layers)
            world = local_world_size(cfg)
            rest.append(_measured_step_s(cfg, world) - predict_step_time(cfg, world, hw).total_s)
        pp, (short, deep) = layout.parallel.get("pp", 1), layout.depths
        block = (rest[1] - rest[0]) / ((deep - short) // pp * MICRO_BATCHES)
        out[layout.name] = [block, rest[0] / MICRO_BATCHES - block * (short // pp)]
    return out


def calibrate(path: Path, model: ModelConfig | None = None, seq_len: int = 256,
              layouts: tuple[CalibratedLayout, ...] = CALIBRATED_LAYOUTS, nbytes: int = 4 << 20,
              repeats: int = 5) -> dict:
    """Measure and write the calibration JSON (parents created); returns what it wrote. The
    fixed costs are those of `model`'s blocks (default: the tiny preset) on `seq_len` tokens:
    on a CPU they depend on the shapes (memory-bound elementwise work grows with them), so
    calibrate with the model and sequence length to be predicted."""
    model = model or ModelConfig()
    results = run_ranks(_measure, 2, (nbytes, repeats), timeout_s=120)
    data = {"matmul_tflops": statistics.mean(r[0] for r in results),
            "gloo_gbps": nbytes / statistics.mean(r[1] for r in results) / 1e9,
            "latency_s": statistics.mean(r[2] for r in results),
            "host_adam_gparams_per_s": statistics.mean(r[3] for r in results),
            "cores": os.cpu_count() or 1, "message_bytes": nbytes}
    data["fixed_costs"] = fixed_costs(data, model, seq_len, layouts)
    data["fixed_costs_for"] = {"model": dataclasses.asdict(model), "seq_len": seq_len}
    data["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1) + "\n", setting="plan.calibration")
    return data


def run(args: CommandArgs) -> int:
    """`lctrain plan --calibrate`: measure, write plan.calibration, print what was measured."""
    cfg = args.composed.cfg
    path = calibration_path(cfg)
    data = calibrate(path, cfg.model, cfg.train.seq_len)
    print(f"fp32 matmul, 1 thread per rank, 2 ranks at once: {data['matmul_tflops']:.4g} TFLOP/s")
    print(f"gloo send/recv of {data['message_bytes']:,} bytes between 2 local ranks: "
          f"{data['gloo_gbps']:.3g} GB/s")
    print(f"gloo latency (a 4-byte send): {data['latency_s'] * 1e6:.0f} us")
    print(f"host AdamW step (foreach, 1 thread per rank): "
          f"{data['host_adam_gparams_per_s'] * 1e3:.3g} M parameters/s")
    print(f"fixed costs per micro-batch of 1 x {cfg.train.seq_len} tokens, model.dim="
          f"{cfg.model.dim} (ms per block / besides the blocks):")
    for layout in CALIBRATED_LAYOUTS:
        block, rest = data["fixed_costs"][layout.name]
        print(f"  {layout.name:<10} {block * 1e3:8.2f} {rest * 1e3:8.2f}   " + " ".join(
            [f"parallel.{k}={v}" for k, v in layout.parallel.items()]
            + [f"train.{k}={v}" for k, v in layout.train.items()]))
    print(f"{data['cores']} CPU cores; written to {path}")
    return 0
