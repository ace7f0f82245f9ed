"""`lctrain plan`: validate a layout for its world size and print its plan (per-rank shapes,
memory, traffic, groups, rank table) as text or JSON, without a process or a device."""

from __future__ import annotations

import json
import sys

from lctrain.commands.checks import preflight
from lctrain.config import ConfigError, LctrainConfig
from lctrain.config.compose import Composed
from lctrain.config.derived import slurm_world
from lctrain.layout.topology import AXES
from lctrain.planning.plan import build_plan


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
            f"{plan['activation_checkpointing']}"
            + (f"; pipeline rank {plan['pipeline']['largest_pp_rank']}, the largest"
               if "pipeline" in plan else "") + "):",
        *(f"  {k}: {v:,.3f}" for k, v in plan["memory_gib"].items()),
        *(pipeline_lines(plan["pipeline"]) if "pipeline" in plan else []),
        *memory_lines(plan["memory_per_rank"]),
        "", "predicted per rank per step (bytes, as metrics.jsonl logs them):",
        *(f"  {k}: {v:,.0f}" for k, v in plan["predicted"].items() if k != "cp_collectives"),
        *(["  cp_collectives:"] + [f"    {k}: {v:,.0f}"
                                   for k, v in plan["predicted"]["cp_collectives"].items()]
          if "cp_collectives" in plan["predicted"] else []),
        "", "traffic per rank (elements sent):",
        *(f"  {k}: {v:,.0f}" for k, v in plan["traffic_elements_per_rank"].items()),
        *(["", "model (value, where it came from):"] +
          [f"  {n:<28} {m['value']!r:<24} {m['origin']}" for n, m in plan["model"].items()]
          if plan.get("model") else []),
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


def memory_lines(mem: dict) -> list[str]:
    """One rank's memory item by item, its total and the verdict."""
    return ["", "memory per rank, itemised (bytes, device):",
            *(f"  {k}: {v:,.0f}" for k, v in mem["bytes"].items()),
            f"  {mem['verdict']} in plan.gpu_memory_gib={mem['gpu_memory_gib']:g} "
            f"(total {mem['total_gib']:,.3f} GiB)",
            *(f"  - {n}" for n in mem["notes"])]


def pipeline_lines(pipe: dict) -> list[str]:
    """The per-stage table of a pipelined plan: activations at the rank's peak, its total."""
    row_format = "  {:>5} {:>7}  {:<8} {:<16} {:>8} {:>9} {:>15} {:>14}"
    lines = ["", f"pipeline: {pipe['schedule']}, {pipe['stages_per_rank']} stage(s) per rank, "
                 f"{pipe['micro_batches']} micro-batches per step, bubble "
                 f"{pipe['bubble_fraction']:.1%}",
             row_format.format("stage", "pp rank", "layers", "holds", "params", "in flight",
                               "activations GiB", "rank total GiB")]
    for row in pipe["stages"]:
        first, last = row["layers"]
        holds = "+".join(n for n in ("embedding", "output") if row[n]) or "-"
        lines.append(row_format.format(
            row["stage"], row["pp_rank"], f"{first}-{last}", holds, f"{row['params'] / 1e9:.3f}B",
            row["micro_batches_in_flight"], f"{row['activations_gib']:,.3f}",
            f"{row['rank_total_gib']:,.3f}"))
    return lines


def plan_world_size(cfg: LctrainConfig) -> int:
    """launch.nproc if set; else the layout's product when every size is fixed; else (dp=-1)
    the Slurm job's ranks (slurm.nodes x slurm.gpus_per_node on GPU nodes)."""
    p = cfg.parallel
    if cfg.launch.nproc is not None:
        return cfg.launch.nproc
    if p.dp != -1:
        return p.tp * p.cp * p.pp * p.dp
    return slurm_world(cfg)


def world_note(cfg: LctrainConfig, world: int) -> list[str]:
    """A note when the planned world differs from what the slurm.* keys would request."""
    slurm = slurm_world(cfg)
    if cfg.launch.nproc is None and cfg.parallel.dp != -1 and slurm != world:
        return [f"planned for the layout's {world} ranks; slurm.nodes x slurm.gpus_per_node = "
                f"{slurm} would not match it (set parallel.dp=-1 to plan for the allocation)"]
    return []


def run(composed: Composed, flags: set[str]) -> int:
    cfg: LctrainConfig = composed.cfg
    world = plan_world_size(cfg)
    problems = preflight(cfg, world)
    if problems:
        raise ConfigError(problems)
    plan = build_plan(cfg, world)
    plan["model"] = {name: {"value": getattr(cfg.model, name),
                            "origin": composed.origins.get(name, "default")}
                     for name in composed.origins}
    plan["notes"] = composed.notes + world_note(cfg, world) + plan["notes"]
    if "--json" in flags or cfg.plan.format == "json":
        json.dump(plan, sys.stdout, indent=1)
        print()
    else:
        print(render_text(plan, cfg.plan.max_rank_rows))
    return 0
