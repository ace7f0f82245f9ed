"""Predicted against measured step time on this CPU: the step-time model of
`lctrain.planning.timing` (docs/parallelism.md §15) with this machine's calibration, beside
`lctrain.training.loop.train` run on forked gloo ranks (1 thread each) in several layouts.

    python bench/plan_time.py                       # calibrates first; 2-3 min on 2 busy cores
    python bench/plan_time.py --steps 6 --seq-len 512 --calibration /tmp/cal.json --reuse

The model is the tiny preset (lctrain's default ModelConfig) at --seq-len tokens, fp32, a step
of --global-batch sequences in micro-batches of 1, no activation checkpointing, no evals or
checkpoints. Every layout uses 2 ranks (dp, cp ring, cp ulysses, tp, pp 1f1b) besides the
1-rank baseline. measured = the median step_time of the steps after the first (which builds
caches and the pipeline's shapes); ratio = predicted / measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.commands.calibrate import calibrate  # noqa: E402
from lctrain.config import LctrainConfig  # noqa: E402
from lctrain.config.validation import validate  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.planning.timing import hardware_for, predict_step_time  # noqa: E402
from lctrain.training.loop import train  # noqa: E402

LAYOUTS = {  # name: parallel.* overrides (2 ranks each but the baseline)
    "1 rank": {},
    "dp2 (fsdp)": {"dp": 2},
    "cp2 ring": {"cp": 2, "attention": "ring"},
    "cp2 ulysses": {"cp": 2, "attention": "ulysses"},
    "tp2 + sp": {"tp": 2, "sp": True},
    "pp2 1f1b": {"pp": 2, "pp_schedule": "1f1b"},
}


def make_cfg(args: argparse.Namespace, parallel: dict) -> LctrainConfig:
    cfg = LctrainConfig()
    cfg.parallel = dataclasses.replace(cfg.parallel, **{"dp": 1, **parallel})
    cfg.train = dataclasses.replace(cfg.train, steps=args.steps, seq_len=args.seq_len,
                                    micro_batch=1, global_batch=args.global_batch, device="cpu",
                                    activation_checkpointing="none")
    cfg.logging = dataclasses.replace(cfg.logging, progress=False, log_every=args.steps)
    cfg.plan = dataclasses.replace(cfg.plan, calibration=str(args.calibration))
    return cfg


def world_of(cfg: LctrainConfig) -> int:
    p = cfg.parallel
    return p.tp * p.cp * p.pp * p.dp


def measure(cfg: LctrainConfig, world: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        history = run_ranks(train, world, (cfg, run_dir), timeout_s=600)[0]
    return statistics.median(h["step_time"] for h in history[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--calibration", type=Path,
                    default=Path(tempfile.gettempdir()) / "lctrain-bench-calibration.json")
    ap.add_argument("--reuse", action="store_true", help="use an existing calibration file")
    args = ap.parse_args()
    if not (args.reuse and args.calibration.is_file()):
        cal = calibrate(args.calibration)
        print(f"calibration: {cal['matmul_tflops']:.4g} TFLOP/s fp32 matmul per rank, "
              f"{cal['gloo_gbps']:.3g} GB/s gloo, {cal['cores']} cores")
    header = f"{'layout':<13} {'predicted s':>11} {'compute':>8} {'comm':>8} {'exposed':>8} " \
             f"{'bubble':>8} {'measured s':>10} {'ratio':>6}"
    print(header, flush=True)
    rows = []
    for name, parallel in LAYOUTS.items():
        cfg = make_cfg(args, parallel)
        world = world_of(cfg)
        problems = validate(cfg, world)
        assert not problems, f"{name}: {problems}"
        hw = hardware_for(cfg, gpu_available=False)
        t = predict_step_time(cfg, world, hw)
        measured = measure(cfg, world)
        rows.append(f"{name:<13} {t.total_s:>11.4f} {t.compute_s:>8.4f} "
                    f"{sum(t.comm_s.values()):>8.4f} {t.exposed_comm_s:>8.4f} "
                    f"{t.bubble_s:>8.4f} {measured:>10.4f} {t.total_s / measured:>6.2f}")
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
