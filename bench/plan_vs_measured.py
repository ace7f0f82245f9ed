"""What `lctrain plan` predicts against what training measures, layout by layout, on this CPU
(docs/parallelism.md §18): the tiny model trained on forked gloo ranks (1 thread each), 12
layouts on 4 ranks that span tp (with and without SP), every context-parallel algorithm,
pipelining under three schedules, FSDP and DDP and every activation-checkpointing mode, and 12
more on 1 or 2 ranks (one per core), none of them a layout the calibration runs.

    python bench/plan_vs_measured.py                     # calibrates first; ~4 min on 2 cores
    python bench/plan_vs_measured.py --calibration /tmp/cal.json --reuse
    python bench/plan_vs_measured.py --only cp4_ring dp2_ddp --no-time

Columns (measured / predicted, or the two side by side):
  traffic   every traffic key metrics.jsonl logs at the last step (cp_bytes_sent, traffic/tp,
            /cp, /pp, /dp) against `build_plan(...)["predicted"]`: "exact" when all are equal;
  act       bytes one micro-batch keeps for the backward (blocks, head, shared planning),
            measured from live storages after one training forward (lctrain.tracing.measure),
            against lctrain.planning.activations' formulas; under pipelining a block keeps the same
            bytes, so the pp rows measure the same model on the same ranks at pp 1;
  state     weights, gradients and AdamW state of the live shards of every rank (local tensors,
            counted in an optimizer step post-hook during training) against `state_parts` for
            that rank's pipeline stage: the worst ratio over ranks and the three parts;
  time      the median step time after the first against `predict_step_time` with this
            machine's calibration (`lctrain plan --calibrate`, made for the same model and
            sequence length). On 4 ranks the 2 cores are oversubscribed, which the model
            prices only as a floor (§15): those times are shown, not claimed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.commands.calibrate import calibrate  # noqa: E402
from lctrain.config import LctrainConfig  # noqa: E402
from lctrain.config.derived import local_world_size  # noqa: E402
from lctrain.config.validation import validate  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.parallel.runtime import setup_distributed  # noqa: E402
from lctrain.planning.activations import (  # noqa: E402
    activation_formula,
    head_activation_formula,
    planning_bytes,
)
from lctrain.planning.estimate import build_plan  # noqa: E402
from lctrain.planning.hardware import hardware_for  # noqa: E402
from lctrain.planning.state import state_parts  # noqa: E402
from lctrain.planning.timing import predict_step_time  # noqa: E402
from lctrain.tracing.measure import build_measured_model, measure_activations  # noqa: E402
from lctrain.training.loop import train  # noqa: E402

TRAFFIC_KEYS = ("cp_bytes_sent", "traffic/cp", "traffic/tp", "traffic/pp", "traffic/dp")
STATE_PARTS = ("weights", "gradients", "optimizer_state")
LAYOUTS = {  # name: (parallel.* overrides, train.* overrides); 4 ranks each
    "dp4_fsdp": ({"dp": 4}, {}),
    "dp4_ddp_full": ({"dp": 4, "dp_engine": "ddp"}, {"activation_checkpointing": "full"}),
    "tp2_cp2_ulysses": ({"tp": 2, "cp": 2, "attention": "ulysses"}, {}),  # tp without SP
    "tp2_sp_dp2_sel": ({"tp": 2, "sp": True, "dp": 2}, {"activation_checkpointing": "selective"}),
    "cp4_ring": ({"cp": 4, "attention": "ring"}, {}),
    "cp4_ulysses": ({"cp": 4, "attention": "ulysses"}, {}),
    "cp4_usp_full": ({"cp": 4, "attention": "usp", "ulysses_degree": 2},
                     {"activation_checkpointing": "full"}),
    "cp2_allgather_dp2": ({"cp": 2, "attention": "allgather", "dp": 2}, {}),
    "tp2_cp2_ring_sel": ({"tp": 2, "sp": True, "cp": 2, "attention": "ring"},
                         {"activation_checkpointing": "selective"}),
    "pp2_dp2_1f1b": ({"pp": 2, "dp": 2, "pp_schedule": "1f1b"}, {}),
    "pp2_cp2_interleaved": ({"pp": 2, "cp": 2, "attention": "ring",
                             "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, {}),
    "pp4_gpipe_full": ({"pp": 4, "pp_schedule": "gpipe"}, {"activation_checkpointing": "full"}),
}
TIME_LAYOUTS = {  # 1 or 2 ranks (one per core), none of them a calibration run's layout
    "1rank_full": ({}, {"activation_checkpointing": "full"}),
    "dp2_ddp": ({"dp": 2, "dp_engine": "ddp"}, {}),
    "dp2_fsdp_sel_acc4": ({"dp": 2}, {"activation_checkpointing": "selective",
                                       "global_batch": 8}),
    "tp2_nosp": ({"tp": 2}, {}),
    "tp2_sp_full": ({"tp": 2, "sp": True}, {"activation_checkpointing": "full"}),
    "cp2_ring_sel": ({"cp": 2, "attention": "ring"}, {"activation_checkpointing": "selective"}),
    "cp2_ring_acc8": ({"cp": 2, "attention": "ring"}, {"global_batch": 8}),
    "cp2_ulysses_full": ({"cp": 2, "attention": "ulysses"}, {"activation_checkpointing": "full"}),
    "cp2_allgather_acc2": ({"cp": 2, "attention": "allgather"}, {"global_batch": 2}),
    "pp2_gpipe": ({"pp": 2, "pp_schedule": "gpipe"}, {}),
    "pp2_interleaved": ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
                        {}),
    "pp2_1f1b_full": ({"pp": 2, "pp_schedule": "1f1b"}, {"activation_checkpointing": "full"}),
}


def make_cfg(name: str, steps: int, seq_len: int, global_batch: int,
             calibration: Path | str = "") -> LctrainConfig:
    """The tiny preset (lctrain's default ModelConfig, fp32) in layout `name` (of LAYOUTS or
    TIME_LAYOUTS), micro-batches of 1 sequence, no evals or checkpoints."""
    parallel, train_overrides = {**LAYOUTS, **TIME_LAYOUTS}[name]
    cfg = LctrainConfig()
    cfg.parallel = dataclasses.replace(cfg.parallel, **{"dp": 1, **parallel})
    cfg.train = dataclasses.replace(cfg.train, **{
        "steps": steps, "seq_len": seq_len, "micro_batch": 1, "global_batch": global_batch,
        "device": "cpu", "activation_checkpointing": "none", **train_overrides})
    cfg.logging = dataclasses.replace(cfg.logging, progress=False, log_every=1)
    if calibration:
        cfg.plan = dataclasses.replace(cfg.plan, calibration=str(calibration))
    problems = validate(cfg, local_world_size(cfg))
    assert not problems, f"{name}: {problems}"
    return cfg


def _local_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _count_state(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Local bytes of the live shards an optimizer step has just used; the gradients are still
    there (training sets them to None after the step)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {"weights": _local_bytes(params),
            "gradients": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer_state": _local_bytes(t for s in optimizer.state.values()
                                            for t in s.values() if torch.is_tensor(t))}


def _first_step_counter(counted: list[dict]):
    """An optimizer step post-hook that appends `_count_state` of the first step to `counted`."""
    def hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not counted:
            counted.append(_count_state(optimizer))
    return hook


def _activation_cfg(cfg: LctrainConfig) -> LctrainConfig:
    """The layout whose one forward measures what a block keeps: pipelining does not change a
    block, so its ranks measure the model at pp 1 (the pipeline ranks become data ranks)."""
    p = cfg.parallel
    if p.pp == 1:
        return cfg
    parallel = dataclasses.replace(p, pp=1, dp=p.dp * p.pp, pp_schedule="1f1b",
                                   pp_virtual_stages=1)
    return dataclasses.replace(cfg, parallel=parallel)


def measure_layouts(cfgs: list[LctrainConfig], run_dirs: list[str]) -> list[dict]:
    """On every rank, for each layout in turn (the process group is reused): train, counting
    the state at the first optimizer step, then measure one forward's activations."""
    out = []
    for cfg, run_dir in zip(cfgs, run_dirs):
        counted: list[dict] = []
        hook = register_optimizer_step_post_hook(_first_step_counter(counted))
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the training log
                history = train(cfg, run_dir)
        finally:
            hook.remove()
        act_cfg = _activation_cfg(cfg)
        activations = measure_activations(*build_measured_model(act_cfg,
                                                                batch=cfg.train.micro_batch))
        out.append({"state": counted[0], "pp_rank": setup_distributed(cfg).axis_rank("pp"),
                    "activations": sum(activations.values()),
                    "step_time": statistics.median(h["step_time"] for h in history[1:])})
    return out


def predicted_activations(cfg: LctrainConfig) -> float:
    act_cfg, batch, world = _activation_cfg(cfg), cfg.train.micro_batch, local_world_size(cfg)
    return (act_cfg.model.n_layers * activation_formula(act_cfg, world, batch)
            + head_activation_formula(act_cfg, world, batch) + planning_bytes(act_cfg, batch))


def compare(name: str, cfg: LctrainConfig, run_dir: str, ranks: list[dict],
            timed: bool) -> dict:
    """One row: each quantity measured, predicted and their ratio."""
    world = local_world_size(cfg)
    plan = build_plan(cfg, world)["predicted"]
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    logged = {k: v for k, v in rows[-1].items() if k in TRAFFIC_KEYS}
    predicted = {k: v for k, v in plan.items() if k in TRAFFIC_KEYS}
    state_ratios = [r["state"][part] / want
                    for r in ranks
                    for part, want in state_parts(cfg, world, r["pp_rank"]).items() if want]
    row = {"layout": name, "ranks": world, "traffic_logged": logged, "traffic_predicted": predicted,
           "traffic_exact": logged == predicted,
           "act_measured": ranks[0]["activations"], "act_predicted": predicted_activations(cfg),
           "state_worst_ratio": max(state_ratios, key=lambda r: abs(r - 1)),
           "state_rank0": ranks[0]["state"]}
    row["act_ratio"] = row["act_measured"] / row["act_predicted"]
    if timed:
        row["time_measured"] = statistics.median(r["step_time"] for r in ranks)
        step = predict_step_time(cfg, world, hardware_for(cfg, gpu_available=False))
        row["time_predicted"] = step.total_s
        row["time_ratio"] = step.total_s / row["time_measured"]
    return row


def run(names: list[str], steps: int, seq_len: int, global_batch: int,
        calibration: Path | str, timed: bool, work_dir: str) -> list[dict]:
    """Every layout in `names`, those of one world size in one spawn of that many ranks."""
    cfgs = {n: make_cfg(n, steps, seq_len, global_batch, calibration) for n in names}
    rows = {}
    for world in sorted({local_world_size(cfg) for cfg in cfgs.values()}):
        group = [n for n in names if local_world_size(cfgs[n]) == world]
        run_dirs = [str(Path(work_dir) / n) for n in group]
        per_rank = run_ranks(measure_layouts, world, ([cfgs[n] for n in group], run_dirs),
                             timeout_s=1800)
        for i, (n, d) in enumerate(zip(group, run_dirs)):
            rows[n] = compare(n, cfgs[n], d, [r[i] for r in per_rank], timed)
    return [rows[n] for n in names]


def table(rows: list[dict]) -> list[str]:
    timed = "time_ratio" in rows[0]
    head = (f"{'layout':<20} {'ranks':>5} {'traffic':>7} {'act measured':>12} {'predicted':>10} "
            f"{'ratio':>6} {'state worst':>11}")
    if timed:
        head += f" {'time meas s':>11} {'pred s':>7} {'ratio':>6}"
    lines = [head]
    for r in rows:
        line = (f"{r['layout']:<20} {r['ranks']:>5} "
                f"{'exact' if r['traffic_exact'] else 'DIFFERS':>7} "
                f"{r['act_measured']:>12,} {r['act_predicted']:>10,.0f} {r['act_ratio']:>6.3f} "
                f"{r['state_worst_ratio']:>11.4f}")
        if timed:
            line += (f" {r['time_measured']:>11.4f} {r['time_predicted']:>7.4f} "
                     f"{r['time_ratio']:>6.2f}")
        lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=[*LAYOUTS, *TIME_LAYOUTS],
                    default=[*LAYOUTS, *TIME_LAYOUTS])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--no-time", action="store_true", help="skip calibration and step times")
    ap.add_argument("--calibration", type=Path,
                    default=Path(tempfile.gettempdir()) / "lctrain-bench-calibration.json")
    ap.add_argument("--reuse", action="store_true", help="use an existing calibration file")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    timed = not args.no_time
    if timed and not (args.reuse and args.calibration.is_file()):
        cal = calibrate(args.calibration, LctrainConfig().model, args.seq_len)
        print(f"calibration: {cal['matmul_tflops']:.4g} TFLOP/s fp32 matmul per rank, "
              f"{cal['gloo_gbps']:.3g} GB/s gloo, {cal['cores']} cores", flush=True)
    with tempfile.TemporaryDirectory() as work_dir:
        rows = run(args.only, args.steps, args.seq_len, args.global_batch,
                   args.calibration if timed else "", timed, work_dir)
    print("\n".join(table(rows)))
    for r in rows:
        if not r["traffic_exact"]:
            print(f"{r['layout']}: logged {r['traffic_logged']} predicted {r['traffic_predicted']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
