"""`lctrain plan --calibrate`: measure this machine's fp32 matmul rate and the gloo bandwidth
between two local ranks, print them, and write them to plan.calibration, which the step-time
model (`lctrain.planning.timing`) uses for CPU runs (docs/parallelism.md §15)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lctrain.config.compose import Composed
from lctrain.parallel.launch import run_ranks
from lctrain.planning.timing import calibration_path
from lctrain.training.files import write_atomic
from lctrain.training.metrics import measure_matmul_tflops


def _measure(nbytes: int, repeats: int) -> tuple[float, float]:
    """On each of 2 ranks at once (1 thread each, as training runs): (matmul TFLOP/s, seconds
    of one one-way send of `nbytes`, the median of `repeats` round trips / 2)."""
    rate = measure_matmul_tflops()
    buf = torch.zeros(nbytes // 4)
    peer = 1 - dist.get_rank()
    times = []
    for i in range(repeats + 1):  # the first round trip sets up the connection: not timed
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
    return rate, statistics.median(times)


def calibrate(path: Path, nbytes: int = 4 << 20, repeats: int = 5) -> dict:
    """Measure and write the calibration JSON (parents created); returns what it wrote."""
    results = run_ranks(_measure, 2, (nbytes, repeats), timeout_s=120)
    seconds = statistics.mean(s for _, s in results)
    data = {"matmul_tflops": statistics.mean(r for r, _ in results),
            "gloo_gbps": nbytes / seconds / 1e9, "cores": os.cpu_count() or 1,
            "message_bytes": nbytes, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                  time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1) + "\n", setting="plan.calibration")
    return data


def run(composed: Composed, flags: set[str]) -> int:
    path = calibration_path(composed.cfg)
    data = calibrate(path)
    print(f"fp32 matmul, 1 thread per rank, 2 ranks at once: {data['matmul_tflops']:.4g} TFLOP/s")
    print(f"gloo send/recv of {data['message_bytes']:,} bytes between 2 local ranks: "
          f"{data['gloo_gbps']:.3g} GB/s")
    print(f"{data['cores']} CPU cores; written to {path}")
    return 0
