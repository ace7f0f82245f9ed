"""Check lctrain's CUDA path on one GPU: PASS / FAIL / SKIP per check, written to a JSON file after
every check, so that a hang or a crash loses nothing already measured.

    python tools/gpu_check.py --out OUT/gpu_check.json [--budget 420] [--quick]  # on a GPU
    python tools/gpu_check.py --dry-run --out gpu_check.json                     # CPU: wiring

Each check runs in a process of its own with its own time limit (a hang, an out-of-memory
crash or a wedged CUDA context fails that check only); an exception is FAIL, and SKIP is kept
for a stated precondition (flash-attn not installed, the budget spent). `--budget` stops
starting checks whose expected time no longer fits. It needs torch only: no flash-attn, hydra,
deepspeed, wandb or datasets (docs/gpu.md gives the one command for an offline GPU machine).

Checks: the environment; every attention backend against float64 (dense and packed documents,
causal or not, MHA / GQA / MQA, bf16 tolerances 2.5e-2 and 3.5e-2 with GQA) and the torch
backend's deterministic backward; the documents split with travelling K/V, window layers and
sinks at cp2 against float64; a tiny Gemma 3, GPT-OSS and Qwen3-MoE trained in bf16 on the GPU
against fp32 on the CPU; the experts' grouped matmul; every context-parallel algorithm with packed documents on 2
and 4 ranks sharing the GPU (gloo, collectives staged through host memory); 20 tiny steps in
bf16 on CUDA against fp32 on the CPU; selective checkpointing's activation bytes; offload and
the tiled loss and MLP; the training state in host memory (parallel.offload_state: losses, pinned
bytes against the plan); torch.compile; one checkpoint save and resume; a Llama-3-8B-shaped step
(2 layers, 64K or 32K tokens) with its loss finite and `lctrain plan`'s time and memory beside
the measured ones; attention throughput in TFLOP/s per backend at 8K / 32K / 128K against the
device's bf16 matmul rate; the host-to-device batch copy.

The checks live in tools/gpu_checks/, one module per family (context: the shared Context and the
environment; kernels, cp, training, memory, scale); this file is the runner.

--dry-run runs the same code on the CPU with tiny sizes: the torch backend through a CPU
implementation of its ops that enforces the CUDA ops' argument rules, so that a change that
breaks the script shows before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from gpu_checks.context import Context, check_env, tiny_cfg  # noqa: E402
from gpu_checks.cp import check_cp_algorithms  # noqa: E402
from gpu_checks.features import check_documents_windows_sinks, check_families_step  # noqa: E402
from gpu_checks.kernels import (  # noqa: E402
    check_kernel_throughput,
    check_kernels,
    check_linear_rule,
    check_moe_grouped_mm,
)
from gpu_checks.memory import (  # noqa: E402
    check_offload_and_tiling,
    check_selective_memory,
    check_state_offload,
)
from gpu_checks.scale import check_step_8b  # noqa: E402
from gpu_checks.training import (  # noqa: E402
    check_batch_transfer,
    check_checkpoint_resume,
    check_compile,
    check_train_tiny,
)

from lctrain.attention.varlen_reference import register_cpu_flash_ops  # noqa: E402
from lctrain.parallel.launch import RankFailure, run_ranks  # noqa: E402
from lctrain.parallel.runtime import setup_distributed  # noqa: E402


@dataclass(frozen=True)
class Check:
    fn: object
    expected_s: float
    """Seconds it takes on an H200 (not started when less of the budget is left)."""
    limit_s: float
    """Seconds after which it is stopped and FAILs."""
    needs_run_dir: bool = False


CHECKS = {  # in order of what a first GPU run must not miss: the paths never run on a GPU first
    "env": Check(check_env, 10, 60),
    "kernels": Check(check_kernels, 25, 120),
    "documents_windows_sinks": Check(check_documents_windows_sinks, 60, 150),
    "families_step": Check(check_families_step, 40, 120, True),
    "moe_grouped_mm": Check(check_moe_grouped_mm, 10, 60),
    "linear_rule": Check(check_linear_rule, 15, 90),
    "cp_algorithms": Check(check_cp_algorithms, 60, 150),
    "train_tiny": Check(check_train_tiny, 25, 90, True),
    "step_8b": Check(check_step_8b, 60, 180, True),
    "kernel_throughput": Check(check_kernel_throughput, 40, 120),
    "checkpoint_resume": Check(check_checkpoint_resume, 25, 90, True),
    "selective_memory": Check(check_selective_memory, 15, 60),
    "offload_and_tiling": Check(check_offload_and_tiling, 20, 90),
    "state_offload": Check(check_state_offload, 20, 90),
    "compile": Check(check_compile, 60, 150, True),
    "batch_transfer": Check(check_batch_transfer, 10, 60),
}


def _run_check(name: str, ctx: Context, run_root: Path) -> dict:
    """One check, in its own process (see `run`)."""
    if ctx.dry_run:
        register_cpu_flash_ops()
    setup_distributed(tiny_cfg(1, ctx.device.type, "fp32"))  # device selection, one process
    check = CHECKS[name]
    return check.fn(ctx, run_root / name) if check.needs_run_dir else check.fn(ctx)


def _write(path: Path, results: list[dict], summary: dict) -> None:
    """The JSON so far, replaced whole (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"summary": summary, "checks": results}, indent=1, default=str))
    os.replace(tmp, path)


def run(ctx: Context, run_root: Path, out: Path, budget_s: float,
        only: list[str] | None = None) -> list[dict]:
    """Every check in its own process with its own time limit, while the budget lasts; the JSON
    is rewritten after each."""
    t_start, results = time.monotonic(), []
    threads = 1 if ctx.dry_run else min(8, os.cpu_count() or 1)
    for name, check in CHECKS.items():
        if only and name not in only:
            continue
        left = budget_s - (time.monotonic() - t_start)
        t0 = time.monotonic()
        if left < check.expected_s:
            result = {"status": "SKIP", "detail": f"budget: {left:.0f} s left of {budget_s:g} "
                                                  f"s, it takes about {check.expected_s:g} s"}
        else:
            limit = min(check.limit_s, left)
            try:
                (result,) = run_ranks(_run_check, 1, (name, ctx, run_root),
                                      start_method="fork" if ctx.dry_run else "spawn",
                                      threads=threads, backend=None, timeout_s=limit)
            except RankFailure as e:
                result = {"status": "FAIL", "detail": e.reason[:600]}
        result.update(name=name, seconds=round(time.monotonic() - t0, 1))
        results.append(result)
        _write(out, results, _summary(results, ctx, time.monotonic() - t_start))
        print(f"{result['status']:<5} {name:<20} {result['detail']}", flush=True)
    return results


def _summary(results: list[dict], ctx: Context, seconds: float) -> dict:
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    return {**counts, "seconds": round(seconds, 1), "dry_run": ctx.dry_run}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the wiring, on the CPU")
    ap.add_argument("--quick", action="store_true", help="fewer sequence lengths")
    ap.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks only")
    ap.add_argument("--budget", type=float, default=420,
                    help="seconds; checks that would not fit are not started (default 420)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/lctrain-gpu-check"))
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("tools/gpu_check.py needs a CUDA GPU (or --dry-run on the CPU)", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.dry_run, args.quick)
    t0 = time.monotonic()
    results = run(ctx, args.run_dir, args.out, args.budget, args.only)
    summary = _summary(results, ctx, time.monotonic() - t0)
    print(f"summary: {summary['PASS']} passed, {summary['FAIL']} failed, {summary['SKIP']} "
          f"skipped in {summary['seconds']} s")
    return 1 if summary["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
