"""`lctrain plan`: validate a layout for its world size and print its plan (per-rank shapes,
memory, traffic, step time, groups, rank table) as text or JSON, without a process or a
device; with plan.search=true, rank every layout for the Slurm allocation instead."""

from __future__ import annotations

import json
import sys

from lctrain import device
from lctrain.commands import CommandArgs
from lctrain.commands.plan_trace import trace_lines, trace_plan
from lctrain.config import ConfigError, LctrainConfig
from lctrain.config.derived import context_stages, plans_gpu_nodes, slurm_world
from lctrain.layout.topology import AXES
from lctrain.parallel.launch import RankFailure
from lctrain.planning.estimate import build_plan
from lctrain.planning.hardware import Hardware, calibration_path, plan_hardware
from lctrain.planning.search import SearchResult, layout_label, search
from lctrain.planning.timing import step_time_summary
from lctrain.prepare.checks import preflight, search_preflight, with_corpus


def packed_lines(table: dict, chosen: str) -> list[str]:
    """The corpus's packed documents under each load balance (plan.documents, §24)."""
    if not table:
        return []
    return ["", "packed documents (plan.documents; the slowest cp rank's attention over the "
                "mean, K/V share sent):",
            *(f"  {name:<10} work max/mean {row['balance']:.3f}, attention "
              f"{row['attention_fraction']:.1%} of one causal sequence's, K/V sent "
              f"{row['share']:.1%}" + ("  <- this run" if name == chosen else "")
              for name, row in table.items())]


def render_text(plan: dict, max_rows: int) -> str:
    lay = plan["layout"]
    lines = [
        f"world size {plan['world_size']}: " + " x ".join(f"{a}={lay[a]}" for a in AXES)
        + f"  (cp={lay['cp']}, sp={lay['sp']})",
        f"attention {plan['attention']}, load balance {plan['load_balance']}, grad accumulation "
        f"{plan['grad_accum']}, {plan['tokens_per_step']:,} tokens/step",
        f"parameters {plan['params_billion']:.3f} B"
        + (f" ({plan['active_params_billion']:.3f} B active per token)"
           if "active_params_billion" in plan else ""),
        "", "per-rank shapes:",
        *(f"  {k}: {v}" for k, v in plan["shapes"].items()),
        *memory_lines(plan),
        *(pipeline_lines(plan["pipeline"]) if "pipeline" in plan else []),
        *host_lines(plan["memory_per_rank"]["host"]),
        "", "predicted per rank per step (bytes, as metrics.jsonl logs them):",
        *(f"  {k}: {v:,.0f}" for k, v in plan["predicted"].items() if k != "cp_collectives"),
        *(["  cp_collectives:"] + [f"    {k}: {v:,.0f}"
                                   for k, v in plan["predicted"]["cp_collectives"].items()]
          if "cp_collectives" in plan["predicted"] else []),
        *step_time_lines(plan["step_time"]),
        *packed_lines(plan.get("packed_documents", {}), plan["load_balance"]),
        *stage_lines(plan.get("stages", [])),
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


def stage_rows(cfg: LctrainConfig, world: int, hw: Hardware) -> list[dict]:
    """train.stages: each stage's steps, shape, memory per rank and predicted step time (the
    plan above is the last stage's)."""
    rows = []
    for stage in context_stages(cfg):
        plan, t = build_plan(stage.cfg, world), stage.cfg.train
        memory = plan["memory_per_rank"]
        time = step_time_summary(stage.cfg, world, hw)
        rows.append({"stage": stage.index, "steps": [stage.first, stage.last],
                     "seq_len": t.seq_len, "global_batch": t.global_batch,
                     "micro_batch": t.micro_batch, "memory_gib": memory["total_gib"],
                     "verdict": memory["verdict"], "step_s": time["total_s"],
                     "stage_s": time["total_s"] * (stage.last - stage.first + 1)})
    return rows


def stage_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "stages (train.stages; the rest of this plan is the last stage's):"]
    for r in rows:
        lines.append(f"  {r['stage']}: steps {r['steps'][0]}-{r['steps'][1]}, seq_len "
                     f"{r['seq_len']:,} x {r['global_batch']} sequences (micro-batch "
                     f"{r['micro_batch']}): {r['memory_gib']:.3f} GiB per rank {r['verdict']}, "
                     f"{r['step_s']:.3g} s per step, {r['stage_s']:.3g} s in all")
    return lines


def step_time_lines(t: dict) -> list[str]:
    """The predicted step: its terms, tokens/s and MFU."""
    comm = ", ".join(f"{g} {v:.3g}" for g, v in t["comm_s"].items())
    return ["", "predicted step time (docs/parallelism.md §15):", f"  rates: {t['rates']}",
            f"  {t['total_s']:.4g} s = compute {t['compute_s']:.4g} (recompute "
            f"{t['recompute_s']:.3g}) + exposed communication {t['exposed_comm_s']:.3g}"
            + (f" (of {comm})" if comm else "")
            + f" + fixed costs {t['fixed_costs_s']:.3g} + bubble {t['bubble_s']:.3g}"
            + (f" + host offload {t['offload_s']:.3g}" if t["offload_s"] else ""),
            f"  {t['tokens_per_s_per_rank']:,.0f} tokens/s per rank, {t['tokens_per_s']:,.0f} "
            f"in all, MFU {t['mfu']:.1%}"]


def memory_lines(plan: dict) -> list[str]:
    """The largest rank's device memory item by item, the allocator allowance as one of the
    items, the one total with its verdict, and what the items count."""
    mem = plan["memory_per_rank"]
    gib = {k: v for k, v in plan["memory_gib"].items() if k not in ("modelled", "total")}
    return ["", f"memory per rank (GiB, device; activation checkpointing "
                f"{plan['activation_checkpointing']}"
                + (f"; pipeline rank {plan['pipeline']['largest_pp_rank']}, the largest"
                   if "pipeline" in plan else "") + "):",
            *(f"  {k}: {v:,.3f}" for k, v in gib.items()),
            f"  total: {mem['total_gib']:,.3f} ({plan['memory_gib']['modelled']:,.3f} modelled "
            f"and the allocator allowance): {mem['verdict']} in "
            f"plan.gpu_memory_gib={mem['gpu_memory_gib']:g}",
            *(f"  - {n}" for n in mem["notes"])]


def host_lines(host: dict) -> list[str]:
    """The host side: what a rank keeps there, the node's total and verdict, the copies."""
    copies = host["copies_per_step_bytes"]
    return ["", "host memory per rank (bytes; parallel.offload_state, "
                "train.offload_activations):",
            *(f"  {k}: {v:,.0f}" for k, v in host["bytes_per_rank"].items()),
            f"  {host['verdict']} in plan.host_memory_gib={host['host_memory_gib']:g} per node "
            f"({host['ranks_per_node']} rank(s): {host['per_node_gib']:,.3f} GiB)",
            f"  host<->device copies per step: {copies['to_device']:,.0f} bytes to the device, "
            f"{copies['to_host']:,.0f} to the host"]


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


def runs_here_on_the_cpu(cfg: LctrainConfig) -> bool:
    """Whether the plan is of GPU nodes (slurm.*, plan.*) while `lctrain train` of the same
    config would run on this machine's CPU (train.device=auto, no GPU here)."""
    return plans_gpu_nodes(cfg) and cfg.train.device == "auto" and device.count() == 0


def world_note(cfg: LctrainConfig, world: int) -> list[str]:
    """A note when the planned world differs from what the slurm.* keys would request; on a
    machine without a GPU, instead, the one note a CPU user acts on."""
    if runs_here_on_the_cpu(cfg):
        return [f"this machine has no GPU: `lctrain train` runs these {world} ranks on its CPU; "
                "the figures here are for GPUs (slurm.*, plan.*); for the CPU run's, "
                "`lctrain plan --calibrate` once, then plan with train.device=cpu"]
    slurm = slurm_world(cfg)
    if cfg.launch.nproc is None and cfg.parallel.dp != -1 and slurm != world:
        return [f"planned for the layout's {world} ranks; slurm.nodes x slurm.gpus_per_node = "
                f"{slurm} would not match it (set parallel.dp=-1 to plan for the allocation)"]
    return []


def whose_rates(cfg: LctrainConfig, hw: Hardware) -> str:
    """Whose rates the predicted step uses, in words: this CPU's calibration, or plan.*'s GPU
    figures (for a CPU run without a calibration, with how to get one)."""
    if hw.source != "plan.*":
        return f"this CPU's, calibrated in {hw.source}"
    figures = f"GPU figures from plan.* ({hw.device_tflops:g} TFLOP/s per GPU)"
    if plans_gpu_nodes(cfg):
        return figures
    return (f"{figures}, not this CPU's: no calibration at {calibration_path(cfg)}; "
            "`lctrain plan --calibrate` measures this machine")


def search_table(result: SearchResult, cfg: LctrainConfig, hw: Hardware) -> str:
    """The plan.search answer: what was searched, then the best plan.top layouts, each with the
    overrides that select it."""
    s = cfg.slurm
    lines = [f"searched {result.layouts:,} valid layouts of {result.world_size} ranks "
             f"(slurm.nodes={s.nodes} x slurm.gpus_per_node={s.gpus_per_node}) for "
             f"train.seq_len={cfg.train.seq_len:,}, train.global_batch={cfg.train.global_batch}: "
             f"{result.evaluated:,} checkpointing/tiling variants sized, {result.too_big:,} "
             f"layouts fit in none, {len(result.ranked):,} fit plan.gpu_memory_gib="
             f"{cfg.plan.gpu_memory_gib:g}; hardware {hw.source}"]
    if not result.ranked:
        return "\n".join(lines + ["no layout fits: more nodes, a shorter train.seq_len, or a "
                                   "larger plan.gpu_memory_gib"])
    row = "{:>4} {:>12} {:>8} {:>6} {:>7}  {}"
    lines += ["", "(under each layout: the overrides that select it, on top of this command's)",
              row.format("rank", "tokens/s/GPU", "step s", "MFU", "GiB", "layout")]
    for i, c in enumerate(result.ranked[:cfg.plan.top], 1):
        lines.append(row.format(i, f"{c.step.tokens_per_s_per_rank:,.0f}",
                                f"{c.step.total_s:.3g}", f"{c.step.mfu:.1%}",
                                f"{c.memory_gib:.1f}", layout_label(c.overrides)))
        lines.append(f"{'':>42}{c.command_line(cfg)}")
    return "\n".join(lines)


def search_json(result: SearchResult, cfg: LctrainConfig, hw: Hardware) -> dict:
    return {"world_size": result.world_size, "layouts": result.layouts,
            "evaluated": result.evaluated, "too_big": result.too_big,
            "fitting": len(result.ranked), "hardware": hw.source,
            "top": [{"overrides": c.overrides, "command_line": c.command_line(cfg),
                     "tokens_per_s_per_rank": c.step.tokens_per_s_per_rank,
                     "step_s": c.step.total_s, "mfu": c.step.mfu, "memory_gib": c.memory_gib}
                    for c in result.ranked[:cfg.plan.top]]}


def run_search(cfg: LctrainConfig, as_json: bool) -> int:
    problems = search_preflight(cfg)
    if problems:
        raise ConfigError(problems)
    cfg = with_corpus(cfg)
    hw, notes = plan_hardware(cfg)
    result = search(cfg, slurm_world(cfg), hw)
    if as_json:
        json.dump(search_json(result, cfg, hw) | {"notes": notes}, sys.stdout, indent=1)
        print()
    else:
        print(search_table(result, cfg, hw))
        for note in notes:
            print(f"note: {note}")
    return 0


def run(args: CommandArgs) -> int:
    composed = args.composed
    cfg: LctrainConfig = composed.cfg
    as_json = "--json" in args.flags or cfg.plan.format == "json"
    traced = "--trace" in args.flags or cfg.plan.trace
    if cfg.plan.search:
        if traced:
            raise ConfigError(["--trace (or plan.trace=true) with plan.search=true: the search "
                               "ranks layouts by the plan's formulas and traces none; search "
                               "first, then trace the layout it picks: lctrain plan "
                               "<its parallel.* settings> --trace"])
        return run_search(cfg, as_json)
    world = plan_world_size(cfg)
    problems = preflight(cfg, world)
    if problems:
        raise ConfigError(problems)
    cfg = with_corpus(cfg)
    plan = build_plan(cfg, world)
    hw, hw_notes = plan_hardware(cfg)
    plan["step_time"] = step_time_summary(cfg, world, hw) | {"rates": whose_rates(cfg, hw)}
    plan["model"] = {name: {"value": getattr(cfg.model, name),
                            "origin": composed.origins.get(name, "default")}
                     for name in composed.origins}
    plan["notes"] = composed.notes + world_note(cfg, world) + hw_notes + plan["notes"]
    if cfg.train.stages:
        plan["stages"] = stage_rows(cfg, world, hw)
    if traced:
        try:
            plan["trace"] = trace_plan(cfg, world, plan)
        except RankFailure as e:  # the traced rank's traceback is above
            print(f"lctrain: the step does not run as configured at full size: {e}",
                  file=sys.stderr)
            return 1
    if as_json:
        json.dump(plan, sys.stdout, indent=1)
        print()
    else:
        text = render_text(plan, cfg.plan.max_rank_rows)
        if "trace" in plan:  # beside the plan's memory, part by part
            text += "\n" + "\n".join(trace_lines(plan["trace"]))
        print(text)
    return 0
