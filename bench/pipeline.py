"""Pipeline bubble of every schedule: the idle time of each pipeline rank, measured and replayed,
beside lctrain.layout.stages.bubble_fraction, and tokens/s against one process.

    python bench/pipeline.py                # pp 2 and 4, m=8 micro-batches: ~45 s on 2 cores
    python bench/pipeline.py --pp 2 --microbatches 16 --steps 8 --seq-len 512

Every schedule runs on forked gloo ranks, one thread each, dp = cp = tp = 1, on the default
(tiny) model shape with --layers blocks. The pp=1 baseline is one process running
`forward_backward` over the same micro-batches (the same micro-batch size, accumulation and
global batch). Only the step's forward and backward are timed (`PipelinedModel.train_step`; no
optimizer), after --warmup untimed steps: the first also runs the schedule's shape inference.
Each step starts at a barrier. The compute of a stage is timed by wrapping, on this bench's
stages only, PipelineStage.forward_one_chunk (F), backward_one_chunk (B, or I when it computes
only input gradients) and backward_weight_one_chunk (W) with wall and thread-CPU clocks;
receive waits and sends happen outside these calls, so they count as idle.

Columns (bubble = idle time / step time of a pipeline rank, averaged over the ranks):
  formula     bubble_fraction(schedule, pp, m, v): equal stages, B = 2 F = I + W, free comms.
  order       the (op, stage, micro-batch) order each rank ran in the last timed step,
              replayed with one dedicated core per rank, the formula's costs (F = I = W = 1,
              B = 2) and free communication: an op starts when its rank is free and its inputs
              exist. It equals the formula when torch runs the schedule the formula describes.
  replay      the same order replayed with the median thread-CPU time of each (stage, op):
              real costs (unequal stages: embedding, output layer and loss; B != 2 F; I + W !=
              B), still dedicated cores and free communication.
  wall        measured: 1 - (wall time inside compute calls) / step time, the step running
              from the barrier to the last rank's end of train_step (in training the grad-norm
              all-reduce makes every rank wait for that); median over steps; `worst`: the
              rank with the largest.
  stretch     wall / thread-CPU time inside compute calls, over all ranks: 1.00 when every rank
              has a core to itself.
  work        thread-CPU time of the compute calls of a step, summed over ranks, over pp=1's
              CPU time per step: what splitting the model adds to the compute (1.00: nothing).
  tok/s       tokens/s over pp=1's, from median step times: `wall` measured; `replay` pp=1's
              CPU time per step over the replay's step, the speed-up dedicated cores and free
              communication would give.

Why three bubbles. With more ranks than cores (rows marked *: pp=4 on a 2-core machine) the OS
time-slices the ranks: a compute call stretches while other ranks compute too, so busy time is
overstated, the wall bubble understated, and the wall-clock speed-up is capped by the cores, not
the schedule. `stretch` shows how much. Thread-CPU time does not run while a rank waits for a
core, so `order` and `replay` do not depend on how cores are shared: they are the numbers to set
beside the formula on such rows (cache and memory-bandwidth contention still inflate CPU time a
little). The wall columns are the pipeline's real behaviour only where pp <= cores and nothing
else loads the machine; their gap to `replay` is then communication and Python overhead between
compute calls. Timestamps come from time.perf_counter, one clock for every process on Linux.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.config import LctrainConfig, ModelConfig  # noqa: E402
from lctrain.config.validation import validate  # noqa: E402
from lctrain.data.batch import IGNORE_INDEX, MicroBatch  # noqa: E402
from lctrain.data.loader import build_loader  # noqa: E402
from lctrain.layout.stages import bubble_fraction, split_layers  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.parallel.parallelize import build_model  # noqa: E402
from lctrain.parallel.runtime import setup_distributed  # noqa: E402
from lctrain.training.step import forward_backward  # noqa: E402

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2}
"""schedule -> virtual stages per rank"""
UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""The formula's op costs, in forwards of one stage."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One compute call of a stage: F forward, B full backward, I input-gradient backward,
    W weight-gradient backward."""

    kind: str
    stage: int
    mb: int
    start: float
    """time.perf_counter at entry, seconds"""
    end: float
    cpu: float
    """thread CPU seconds inside the call"""


@dataclasses.dataclass(frozen=True)
class Step:
    """One timed step on one rank."""

    start: float
    end: float
    ops: tuple[Op, ...]


def make_cfg(args: argparse.Namespace, pp: int, schedule: str) -> LctrainConfig:
    """The tiny preset's shape with --layers blocks, dp = cp = tp = 1, m micro-batches a step,
    no activation checkpointing (a backward then costs what the formula assumes, ~2 forwards)."""
    cfg = LctrainConfig(model=ModelConfig(n_layers=args.layers))  # the tiny preset's shape
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=pp, pp_schedule=schedule,
                                       pp_virtual_stages=SCHEDULES[schedule] if pp > 1 else 1)
    cfg.train = dataclasses.replace(
        cfg.train, seq_len=args.seq_len, micro_batch=args.micro_batch, device="cpu",
        global_batch=args.microbatches * args.micro_batch, activation_checkpointing="none")
    return cfg


def record_compute(stages: list[PipelineStage], ops: list[Op]) -> None:
    """Shadow each stage's compute methods with a wrapper that appends an Op per call."""
    for stage in stages:
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                           ("backward_weight_one_chunk", "W")):
            setattr(stage, name, _timed(getattr(stage, name), kind, stage.stage_index, ops))


def _timed(method: Callable, kind: str, stage: int, ops: list[Op]) -> Callable:
    signature = inspect.signature(method)
    chunk_id = next(iter(signature.parameters))  # fwd_chunk_id or bwd_chunk_id: the micro-batch

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        name = "I" if kind == "B" and not bound.get("full_backward", True) else kind
        wall, cpu = time.perf_counter(), time.thread_time()
        out = method(*args, **kwargs)
        ops.append(Op(name, stage, bound[chunk_id], wall, time.perf_counter(),
                      time.thread_time() - cpu))
        return out

    return call


def _loss_scale(mbs: list[MicroBatch]) -> float:
    return 1.0 / sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs)


def run_pipeline(cfg: LctrainConfig, warmup: int, steps: int) -> list[Step]:
    """On each pipeline rank: the timed steps of `cfg`'s schedule with their compute calls."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
    ops: list[Op] = []
    record_compute(model.stages, ops)
    out = []
    for step in range(warmup + steps):
        mbs = loader.next_step()
        model.zero_grad(set_to_none=True)
        ops.clear()
        dist.barrier()
        start = time.perf_counter()
        model.train_step(mbs, _loss_scale(mbs))
        if step >= warmup:
            out.append(Step(start, time.perf_counter(), tuple(ops)))
    return out


def run_single(cfg: LctrainConfig, warmup: int, steps: int) -> list[tuple[float, float]]:
    """(wall, thread CPU) seconds of each timed step of the same micro-batches in one process."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
    out = []
    for step in range(warmup + steps):
        mbs = loader.next_step()
        model.zero_grad(set_to_none=True)
        scale = _loss_scale(mbs)
        wall, cpu = time.perf_counter(), time.thread_time()
        for mb in mbs:
            forward_backward(model, mb, scale, rt)
        if step >= warmup:
            out.append((time.perf_counter() - wall, time.thread_time() - cpu))
    return out


def replay(orders: list[list[Op]],
           cost: Callable[[Op], float]) -> tuple[float, list[float]]:
    """(step time, bubble of each rank) when every rank runs its recorded op order on a
    dedicated core with free communication: an op starts once its rank is free and its inputs
    exist (F after the previous stage's F, B or I after its own F and the next stage's B or I,
    W after its I)."""
    last = max(op.stage for order in orders for op in order)
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (input grads) | "W", stage, mb)
    free, busy, nxt = [0.0] * len(orders), [0.0] * len(orders), [0] * len(orders)

    def needs(op: Op) -> list[tuple[str, int, int]]:
        if op.kind == "F":
            return [("F", op.stage - 1, op.mb)] if op.stage > 0 else []
        if op.kind == "W":
            return [("G", op.stage, op.mb)]
        return [("F", op.stage, op.mb)] + ([("G", op.stage + 1, op.mb)] if op.stage < last
                                           else [])

    while any(n < len(order) for n, order in zip(nxt, orders)):
        moved = False
        for r, order in enumerate(orders):
            while nxt[r] < len(order) and all(k in done for k in needs(order[nxt[r]])):
                op = order[nxt[r]]
                start = max([free[r], *(done[k] for k in needs(op))])
                free[r] = start + cost(op)
                busy[r] += cost(op)
                done[("G" if op.kind in "BI" else op.kind, op.stage, op.mb)] = free[r]
                nxt[r], moved = nxt[r] + 1, True
        assert moved, "the recorded orders wait on each other: an op is missing"
    span = max(free)
    return span, [1 - b / span for b in busy]


def summarize(ranks: list[list[Step]]) -> dict[str, float | list[float]]:
    """Bubbles of one (schedule, pp) run from every rank's timed steps."""
    steps = list(zip(*ranks))  # [step][rank]
    spans = [max(s.end for s in step) - min(s.start for s in step) for step in steps]
    # medians over steps: other processes on the machine hit single steps
    wall = [statistics.median(1 - sum(op.end - op.start for op in s.ops) / span
                              for s, span in zip(rank, spans)) for rank in ranks]
    every_op = [op for rank in ranks for s in rank for op in s.ops]
    stretch = sum(op.end - op.start for op in every_op) / sum(op.cpu for op in every_op)
    by_kind: dict[tuple[int, str], list[float]] = {}
    for op in every_op:
        by_kind.setdefault((op.stage, op.kind), []).append(op.cpu)
    median = {key: statistics.median(v) for key, v in by_kind.items()}
    orders = [list(rank[-1].ops) for rank in ranks]
    cpu_span, cpu_bubbles = replay(orders, lambda op: median[op.stage, op.kind])
    return {"order": replay(orders, lambda op: UNIT_COSTS[op.kind])[1], "replay": cpu_bubbles,
            "wall": wall, "stretch": stretch, "span": statistics.median(spans),
            "cpu_per_step": sum(op.cpu for op in every_op) / len(steps),
            "cpu_span": cpu_span}


def header(args: argparse.Namespace, cores: int) -> str:
    cfg = make_cfg(args, 1, "1f1b")
    m = cfg.model
    tokens = args.microbatches * args.micro_batch * args.seq_len
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"pipeline bubble, tiny model (dim {m.dim}, {m.n_layers} layers, vocab "
            f"{m.vocab_size}), seq_len {args.seq_len}, micro_batch {args.micro_batch}, "
            f"m={args.microbatches} micro-batches = {tokens} tokens per step, {args.warmup} "
            f"warm-up + {args.steps} timed steps, fp32, one thread per rank | torch "
            f"{torch.__version__}\n"
            f"cores: os.cpu_count() = {os.cpu_count()}, usable = {cores}, load average "
            f"{load}. Rows marked * run more ranks than cores: their wall and tok/s columns "
            f"measure time-slicing (see stretch); read order/replay against the formula there.")


def stage_layers(args: argparse.Namespace, pp: int) -> str:
    """Blocks of each stage (the balanced split) at 1 and 2 virtual stages."""
    splits = {v: [len(s) for s in split_layers(make_cfg(args, pp, schedule))]
              for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2))}
    return ", ".join(f"v={v}: {counts}" for v, counts in splits.items())


def print_row(schedule: str, pp: int, m: int, cores: int, res: dict, single: dict) -> None:
    v = SCHEDULES[schedule]
    mark = "*" if pp > cores else " "
    speed = single["wall"] / res["span"]
    ideal = single["cpu"] / res["cpu_span"]
    work = res["cpu_per_step"] / single["cpu"]
    print(f"{schedule:<17}{mark}{pp:>3}{v:>3}{m:>4} {bubble_fraction(schedule, pp, m, v):>8.3f}"
          f" {statistics.mean(res['order']):>6.3f} {statistics.mean(res['replay']):>6.3f}"
          f" {statistics.mean(res['wall']):>6.3f} {max(res['wall']):>6.3f}"
          f" {res['stretch']:>7.2f} {work:>5.2f} {speed:>6.2f} {ideal:>6.2f}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes")
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=8, help="m, micro-batches per step")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=8, help="blocks; at least pp x virtual stages")
    p.add_argument("--steps", type=int, default=8, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (shape inference)")
    args = p.parse_args()
    problems = [f"--{k.replace('_', '-')} must be >= 1; got {v}" for k, v in [
        ("microbatches", args.microbatches), ("micro_batch", args.micro_batch),
        ("seq_len", args.seq_len), ("layers", args.layers), ("steps", args.steps),
        ("warmup", args.warmup)] if v < 1]
    if min(args.pp) < 2:
        problems.append(f"--pp sizes must be >= 2 (pp=1 is the baseline); got {args.pp}")
    if problems:
        p.error("; ".join(problems))
    return args


def main() -> None:
    args = parse_args()
    cores = len(os.sched_getaffinity(0))
    print(header(args, cores), flush=True)
    runs = run_ranks(run_single, 1, (make_cfg(args, 1, "1f1b"), args.warmup, args.steps),
                     backend=None, timeout_s=600)[0]
    single = {"wall": statistics.median(w for w, _ in runs),
              "cpu": statistics.median(c for _, c in runs)}
    tokens = args.microbatches * args.micro_batch * args.seq_len
    print(f"pp=1 (one process): {single['wall'] * 1e3:.0f} ms per step, "
          f"{tokens / single['wall']:,.0f} tokens/s\n")
    print(f"{'':<28} {' bubble: idle / step time ':-^36}{'':>14}{' tok/s/pp=1 ':-^14}")
    print(f"{'schedule':<18}{'pp':>3}{'v':>3}{'m':>4} {'formula':>8} {'order':>6} {'replay':>6}"
          f" {'wall':>6} {'worst':>6} {'stretch':>7} {'work':>5} {'wall':>6} {'replay':>6}")
    for pp in args.pp:
        for schedule in args.schedules:
            cfg = make_cfg(args, pp, schedule)
            problems = validate(cfg, pp)
            if problems:
                print(f"{schedule:<18}{pp:>3}  skipped: {'; '.join(problems)}", flush=True)
                continue
            ranks = run_ranks(run_pipeline, pp, (cfg, args.warmup, args.steps), timeout_s=600)
            print_row(schedule, pp, args.microbatches, cores, summarize(ranks), single)
        print(f"{'':<18}layers per stage: {stage_layers(args, pp)}", flush=True)
    print("\nformula: bubble_fraction; order: the executed op order replayed at the formula's "
          "costs; replay: at measured CPU costs; wall: measured, worst = worst rank; work: compute "
          "CPU time / pp=1's (details: python bench/pipeline.py -h)")


if __name__ == "__main__":
    main()
