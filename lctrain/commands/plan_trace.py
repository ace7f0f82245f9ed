"""`lctrain plan --trace` (plan.trace=true): one training step of each rank role traced at full
size (lctrain.tracing.trace) and set beside the plan's memory, part by part."""

from __future__ import annotations

import sys
import time

from lctrain.config import ConfigError, LctrainConfig
from lctrain.config.derived import plans_gpu_nodes
from lctrain.config.device_rules import cuda_problems
from lctrain.planning.estimate import rank_memory
from lctrain.tracing import trace

GIB = 2**30

PLAN_ITEMS = {"parameters": ("weights",),
              "gradients": ("gradients", "accumulated_gradients"),
              "optimizer_state": ("optimizer_state",), "activations": ("activations_kept",),
              "temporaries": ("fsdp_gathered_weights", "backward_working_set",
                              "attention_buffers", "pipeline_buffers")}
"""Each traced part and the plan's memory items nearest to it. The plan adds up each item's
largest value, the trace sees one moment: at a peak at the end of a forward the gradients are
the unsharded ones alone and the logits' working tensors are the forward's (activations), at a
peak in a backward they are the backward's (temporaries); the totals compare like for like."""

UNSEEN = ("the caching allocator's rounding and fragmentation, NCCL's buffers, the CUDA context "
          "and the kernels' workspaces")


def trace_plan(cfg: LctrainConfig, world_size: int, plan: dict) -> dict:
    """Each role's traced peak and parts beside the plan's for its pipeline rank, with the
    kernel path taken; a progress line per role on stderr. Raises ConfigError for what the
    trace cannot run."""
    cuda = plans_gpu_nodes(cfg)  # the trace then takes the CUDA path
    problems = [f"{problem} (--trace runs the CUDA code path for GPU nodes, slurm.gpus_per_node="
                f"{cfg.slurm.gpus_per_node}; train.device=cpu traces the CPU path)"
                for problem in (cuda_problems(cfg) if cuda else [])]
    if cfg.parallel.dp_engine == "deepspeed":
        problems.append("parallel.dp_engine=deepspeed: DeepSpeed's engine cannot run on fake "
                        "tensors; trace the same layout with parallel.dp_engine=fsdp")
    if problems:
        raise ConfigError(problems)
    rows = []
    for rank, pp_rank, role in trace.roles(cfg, world_size):
        planned = rank_memory(cfg, world_size, pp_rank)["itemised"]["bytes"]
        print(f"lctrain: tracing rank {rank} ({role}) of {world_size} on fake tensors ...",
              file=sys.stderr, flush=True)
        started = time.perf_counter()
        out = trace.trace_apart(cfg, world_size, rank, max(1, cfg.slurm.gpus_per_node), cuda)
        print(f"lctrain: traced in {time.perf_counter() - started:.1f} s ({out['ops']:,} ops)",
              file=sys.stderr, flush=True)
        plan_parts = {part: sum(planned.get(k, 0.0) for k in items)
                      for part, items in PLAN_ITEMS.items()}
        rows.append({"rank": rank, "role": role, "peak_bytes": out["peak"], "at": out["at"],
                     "largest_at_peak": out["largest_at_peak"],
                     "parts_bytes": out["parts"], "plan_modelled_bytes": planned["modelled"],
                     "plan_parts_bytes": plan_parts,
                     "traced_over_plan": out["peak"] / planned["modelled"],
                     "host_syncs": out["host_syncs"],
                     "seconds": out["seconds"] + out["build_seconds"], "ops": out["ops"]})
    return {"path": "cuda" if cuda else "cpu", "world_size": world_size, "roles": rows,
            "allocator_allowance_bytes": plan["memory_per_rank"]["bytes"]["allocator_allowance"],
            "unseen": UNSEEN}


def trace_lines(traced: dict) -> list[str]:
    """The trace beside the plan, part by part (GiB), for each role."""
    path = ("the CUDA code path (flash-attention ops on their meta kernels)"
            if traced["path"] == "cuda" else "the CPU code path")
    lines = ["", f"traced step (lctrain plan --trace: one optimizer step on fake tensors, a fake "
                 f"process group of {traced['world_size']} ranks, {path}; GiB):",
             "  {:<28} {:>10} {:>10} {:>8}".format("role / part", "traced", "plan", "ratio")]
    for row in traced["roles"]:
        at = row["at"]
        lines.append("  {:<28} {:>10.3f} {:>10.3f} {:>8.3f}".format(
            f"rank {row['rank']} ({row['role']})", row["peak_bytes"] / GIB,
            row["plan_modelled_bytes"] / GIB, row["traced_over_plan"]))
        lines.append(f"    peak in micro-step {at['micro_step']} of {at['micro_steps']}, "
                     f"{at['phase']}, at {at['op']}")
        for part, value in row["parts_bytes"].items():
            plan = row["plan_parts_bytes"][part]
            lines.append("    {:<26} {:>10.3f} {:>10.3f} {:>8}".format(
                part, value / GIB, plan / GIB, f"{value / plan:.3f}" if plan else "-"))
        lines.append("    largest made during the step and alive at the peak: " + ", ".join(
            f"{r['bytes'] / GIB:.3f} ({r['op'].removeprefix('aten.')}, {r['phase']})"
            for r in row["largest_at_peak"][:5]))
        lines += _sync_lines(row["host_syncs"])
    lines.append(f"  not seen by the trace: {traced['unseen']}; the plan's allocator_allowance "
                 f"({traced['allocator_allowance_bytes'] / GIB:.3f} GiB) stands for them")
    return lines


def _sync_lines(syncs: dict | None) -> list[str]:
    """The host syncs of the traced step, by phase, and where each is asked for."""
    if syncs is None:  # the CPU path: host and device are one
        return []
    phases = ", ".join(f"{phase} {n}" for phase, n in syncs["by_phase"].items())
    lines = [f"    host syncs per step: {syncs['per_step']}" + (f" ({phases})" if phases else "")]
    lines += [f"      {site['count']:>4} x {site['what']} in the {site['phase']} at "
              f"{site['where']}" for site in syncs["sites"]]
    return lines
