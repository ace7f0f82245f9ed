"""Weights, gradients and optimizer state per rank under each data-parallel engine (DDP, FSDP2,
DeepSpeed ZeRO-1, 2, 3 and ZeRO-3 with the optimizer and weights on the host), measured beside
the formulas of docs/parallelism.md §9 and §12, and the step time of each.

    python bench/engines.py                 # dp 2 and 4, ~20M parameters: ~2 min on 2 cores
    python bench/engines.py --dp 2 --engines ddp zero3 --dim 256 --vocab 4096 --layers 2

Every engine trains the same model on forked gloo ranks (one thread each, dp ranks, cp = tp =
pp = 1, fp32, micro_batch 1, no accumulation) with lctrain's own build and step
(`build_model`, `build_optimizer`, `deepspeed_engine.initialize`, `train_step`). Step time: the
median of --steps steps after --warmup, each started at a barrier. Then one more step is
probed: the tensors the rank holds are counted at up to three instants,
  reduce   end of autograd's backward, before DeepSpeed's reduction epilogue (DeepSpeed only:
           `engine.allreduce_gradients` is wrapped; ZeRO-1 reduces its full gradients there);
  step     entry of the optimizer step, gradients reduced (`engine.step` wrapped; for DDP and
           FSDP AdamW's step pre-hook, after clipping);
  after    after the whole step (optimizer state exists, gradients were freed).

What is counted. Each storage once (`untyped_storage().data_ptr()`), at its allocated size
(padding included), claimed by the first component that reaches it, in the order the detail
table lists them. DDP/FSDP: the parameters (FSDP: DTensor local shards), their .grad, AdamW's
state tensors, and DDP's gradient buckets (recorded by a comm hook that runs torch's default
allreduce hook: with gradient_as_bucket_view, lctrain's setting, the .grad are views of them,
so they count as grads). DeepSpeed, read off the ZeRO optimizer objects (deepspeed/runtime/zero/stage_1_and_2.py,
stage3.py): ZeRO-1/2 the model's flat parameter buffer (`bit16_groups_flat`: fp32 here, it is
the model's dtype), the fp32 master partition (`single_partition_of_fp32_groups`), the
parameters' .grad, the reduced gradient partition (`grads_in_partition`, `averaged_gradients`)
and the inner AdamW's state; ZeRO-3 the gathered parameters (`ds_persist` ones stay whole),
the parameter partitions (`ds_tensor`), the fp32 master partition (`fp32_partitioned_groups_flat`),
the gradient partition buffer (`grad_partitions_flat_buffer`) and the master's .grad, AdamW's
state. `buffers`: the reduce buckets (DeepSpeed's `ipg_buckets`, reduce_bucket_size
elements, at their nominal size: on the CPU only the pages written become resident). Whatever
else Python can reach (gc) is `other` (RoPE tables, the batch): the check that nothing is missed.
Host: on this CPU-only machine device and host are the same memory, so a tensor is `host` when
DeepSpeed put it on its offload device: the ds_tensor partitions under offload_param, the fp32
master partition, its gradients (`grad_partitions_flat_buffer` too: it lives on the optimizer's
device) and AdamW's state under offload_optimizer.

Columns (MiB per rank; P = lctrain.config.model_size.param_count, n = dp): measured (`meas`)
beside the formula (`form`) of lctrain's 16 bytes per parameter: weights 4P, or 4P/n where
sharded (FSDP, ZeRO-3); gradients 4P (DDP, ZeRO-1) or 4P/n (FSDP, ZeRO-2, ZeRO-3); optimizer
8P (DDP) or 8P/n; under offload the device formulas are 0 and `host` is 16P/n. Weights,
optimizer and host are read `after` the step, gradients and buffers at the instant where they
are largest. `device total` = weights + grads + optimizer on the device, beside its formula and
`plan` (lctrain.planning.state.state_bytes_per_rank, what `lctrain plan` reports).

Where DeepSpeed (0.19.8, fp32) holds more than the formula, the detail tables show why:
ZeRO-1/2 keep the model's whole parameters and an fp32 master partition beside them (+4P/n);
ZeRO-3 keeps its partition and a master copy too (its no-copy branch compares a torch.device
with the accelerator's device string, which is never equal), plus whole copies of the
parameters under stage3_param_persistence_threshold; ZeRO-2's (and ZeRO-1's) reduced gradient
buffer holds every parameter that overlaps the rank's partition whole, so ranks whose
partition cuts the embedding or the output layer hold up to a whole one more; with offload the
host has the partition, the master copy, two gradient partitions and the moments (24P/n). The
reduce bucket (5e8 elements by default) is allocated in every ZeRO-1/2 backward and kept for
good by ZeRO-3.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.config import LctrainConfig, ModelConfig  # noqa: E402
from lctrain.config.model_size import param_count  # noqa: E402
from lctrain.config.validation import validate  # noqa: E402
from lctrain.data.loader import build_loader  # noqa: E402
from lctrain.parallel import deepspeed_engine  # noqa: E402
from lctrain.parallel.data_parallel import data_parallel_engine  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.parallel.parallelize import build_model  # noqa: E402
from lctrain.parallel.runtime import setup_distributed  # noqa: E402
from lctrain.planning.state import state_bytes_per_rank  # noqa: E402
from lctrain.training.optim import build_optimizer, build_scheduler  # noqa: E402
from lctrain.training.step import train_step  # noqa: E402

MIB = 2**20
ENGINES = {  # name -> (parallel.dp_engine, deepspeed section)
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "zero1": ("deepspeed", {"zero_stage": 1}),
    "zero2": ("deepspeed", {"zero_stage": 2}),
    "zero3": ("deepspeed", {"zero_stage": 3}),
    "zero3_offload": ("deepspeed", {"zero_stage": 3, "offload_optimizer": "cpu",
                                    "offload_param": "cpu"}),
}
SHARDED = {  # name -> the categories sharded over dp (the rest replicated)
    "ddp": (), "fsdp": ("weights", "grads", "optimizer"), "zero1": ("optimizer",),
    "zero2": ("grads", "optimizer"), "zero3": ("weights", "grads", "optimizer"),
    "zero3_offload": ("weights", "grads", "optimizer"),
}
OFFLOADED = {"zero3_offload": ("weights", "grads", "optimizer")}
"""name -> the categories the formula puts in host memory."""
BYTES_PER_PARAM = {"weights": 4, "grads": 4, "optimizer": 8}
"""lctrain.planning.state.state_parts under FSDP and DDP: 16 bytes per parameter, split."""
INSTANTS = ("reduce", "step", "after")


class Ledger:
    """Bytes per (category, component, place), each storage counted once: the first claim of a
    storage wins."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes: dict[tuple[str, str, str], int] = defaultdict(int)

    def claim(self, category: str, component: str, tensors: Iterable, host: bool = False):
        key = (category, component, "host" if host else "device")
        self.bytes[key] += 0  # listed even when empty
        for t in tensors:
            t = getattr(t, "_local_tensor", t)  # a DTensor's local shard
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.bytes[key] += storage.nbytes()


def tensors_in(obj) -> Iterator[torch.Tensor]:
    """Every tensor in nested lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


def live_tensors() -> list[torch.Tensor]:
    """Every tensor object the garbage collector tracks (type(), not isinstance: some deprecated
    torch objects warn when asked for their class)."""
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def claim_torch(ledger: Ledger, model: nn.Module, optimizer, buckets: dict) -> None:
    params = list(model.parameters())
    ledger.claim("weights", "parameters", params)
    # DDP's gradients are views of its buckets (gradient_as_bucket_view): grads, not buffers
    ledger.claim("grads", "parameter .grad", [p.grad for p in params])
    if isinstance(model, nn.parallel.DistributedDataParallel):
        ledger.claim("buffers", "DDP gradient buckets", buckets.values())
    ledger.claim("optimizer", "AdamW exp_avg, exp_avg_sq, step", tensors_in(optimizer.state))


def claim_zero12(ledger: Ledger, engine) -> None:
    zo, params = engine.optimizer, list(engine.module.parameters())
    host = bool(zo.cpu_offload)
    ledger.claim("weights", "model parameters: flat buffer, whole", zo.bit16_groups_flat)
    ledger.claim("weights", "fp32 master partition (a copy)", zo.single_partition_of_fp32_groups,
                 host)
    ledger.claim("buffers", f"reduce bucket ({zo.reduce_bucket_size:.0e} elements)",
                 tensors_in([b.buffer for b in zo.ipg_buckets.values()]))
    ledger.claim("grads", "parameter .grad", [getattr(p, a, None) for p in params
                                              for a in ("grad", "grad_accum")])
    ledger.claim("grads", "reduced partition: whole params overlapping it",
                 [zo.grads_in_partition, *tensors_in(zo.averaged_gradients)])
    ledger.claim("grads", "fp32 master partition .grad",
                 [t.grad for t in zo.single_partition_of_fp32_groups], host)
    ledger.claim("optimizer", "AdamW state of the master partition",
                 tensors_in(zo.optimizer.state), host)


def claim_zero3(ledger: Ledger, engine) -> None:
    zo, params = engine.optimizer, list(engine.module.parameters())
    host_w, host_o = bool(zo.offload_param), bool(zo.offload_optimizer)
    threshold = zo.parameter_offload.param_numel_persistence_threshold
    ledger.claim("weights", f"gathered params (persistent: < {threshold:.0e} elements)",
                 [p.data for p in params])
    ledger.claim("weights", "parameter partitions (ds_tensor)", [p.ds_tensor for p in params],
                 host_w)
    ledger.claim("weights", "fp32 master partition", zo.fp32_partitioned_groups_flat, host_o)
    ledger.claim("buffers", f"reduce bucket ({zo.reduce_bucket_size:.0e} elements)",
                 [b.buffer for b in zo.ipg_buckets.values()])
    ledger.claim("grads", "parameter .grad", [p.grad for p in params])
    ledger.claim("grads", "gradient partition buffer", [zo.grad_partitions_flat_buffer], host_o)
    ledger.claim("grads", "fp32 master partition .grad, averaged_gradients",
                 [*(t.grad for t in zo.fp32_partitioned_groups_flat),
                  *tensors_in(zo.averaged_gradients)], host_o)
    ledger.claim("optimizer", "AdamW state of the master partition",
                 tensors_in(zo.optimizer.state), host_o)


def count_states(model: nn.Module, optimizer, buckets: dict) -> dict:
    """(category, component, place) -> bytes this rank holds now."""
    ledger = Ledger()
    if not deepspeed_engine.is_engine(model):
        claim_torch(ledger, model, optimizer, buckets)
    elif model.zero_optimization_stage() == 3:
        claim_zero3(ledger, model)
    else:
        claim_zero12(ledger, model)
    ledger.claim("other", "model buffers (RoPE tables)", model.buffers())
    ledger.claim("other", "anything else Python reaches (gc)", live_tensors())
    return dict(ledger.bytes)


def record_ddp_buckets(model: nn.Module) -> dict[int, torch.Tensor]:
    """DDP's gradient bucket of each index, as its last reduction saw it (the reduction is
    torch's default allreduce hook, which is what DDP runs without one)."""
    buckets: dict[int, torch.Tensor] = {}

    def hook(group, bucket):
        buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(group, bucket)

    model.register_comm_hook(model.process_group, hook)
    return buckets


@contextlib.contextmanager
def probes(model: nn.Module, optimizer, probe: Callable[[str], None]):
    """probe('reduce') and probe('step') at those instants of the steps run inside."""
    if not deepspeed_engine.is_engine(model):
        handle = optimizer.register_step_pre_hook(lambda *_: probe("step"))
        try:
            yield
        finally:
            handle.remove()
        return
    for name, instant in (("allreduce_gradients", "reduce"), ("step", "step")):
        setattr(model, name, _before(getattr(model, name), lambda i=instant: probe(i)))
    try:
        yield
    finally:
        del model.allreduce_gradients, model.step  # the class's methods again


def _before(method: Callable, first: Callable[[], None]) -> Callable:
    def call(*args, **kwargs):
        first()
        return method(*args, **kwargs)
    return call


def run_engine(cfg: LctrainConfig, warmup: int, steps: int) -> dict:
    """On each rank: step times, then the states counted at each instant of one more step."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rt = setup_distributed(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, rt)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    if data_parallel_engine(cfg, rt) == "deepspeed":
        with contextlib.redirect_stdout(sys.stderr):  # its op loader prints into the table
            model = deepspeed_engine.initialize(model, optimizer, cfg, rt)
    buckets = (record_ddp_buckets(model)
               if isinstance(model, nn.parallel.DistributedDataParallel) else {})
    loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
    times = []
    for step in range(warmup + steps):
        micro_batches = loader.next_step()
        dist.barrier()
        start = time.perf_counter()
        train_step(model, optimizer, scheduler, micro_batches, cfg, rt)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    counts: dict[str, dict] = {}
    micro_batches = loader.next_step()
    dist.barrier()
    with probes(model, optimizer, lambda i: counts.__setitem__(
            i, count_states(model, optimizer, buckets))):
        train_step(model, optimizer, scheduler, micro_batches, cfg, rt)
    counts["after"] = count_states(model, optimizer, buckets)
    persistent = sum(p.ds_numel for p in model.module.parameters()
                     if getattr(p, "ds_persist", False)) if deepspeed_engine.is_engine(model) else 0
    return {"step_s": statistics.median(times), "counts": counts, "persistent": persistent}


def make_cfg(args: argparse.Namespace, name: str, dp: int) -> LctrainConfig:
    """The bench model (tiny preset's layout: 8 heads, 2 KV heads, SwiGLU 3 x dim) on dp
    ranks under engine `name`; one sequence per rank and step."""
    dp_engine, zero = ENGINES[name]
    cfg = LctrainConfig(model=ModelConfig(vocab_size=args.vocab, dim=args.dim,
                                          n_layers=args.layers, ffn_dim=3 * args.dim))
    cfg.parallel = dataclasses.replace(cfg.parallel, dp=dp, dp_engine=dp_engine)
    cfg.deepspeed = dataclasses.replace(cfg.deepspeed, **zero)
    cfg.train = dataclasses.replace(
        cfg.train, seq_len=args.seq_len, micro_batch=1, global_batch=dp, device="cpu",
        steps=args.warmup + args.steps + 1, activation_checkpointing="none")
    cfg.logging.progress = False
    return cfg


def formula(name: str, P: int, dp: int) -> dict[str, float]:
    """Bytes per rank of each category by lctrain's 16 bytes per parameter."""
    out = {c: b * P / (dp if c in SHARDED[name] else 1) for c, b in BYTES_PER_PARAM.items()}
    out["host"] = 0.0
    for c in OFFLOADED.get(name, ()):
        out["host"] += out[c]
        out[c] = 0.0
    return out


def summarize(counts: dict[str, dict]) -> dict[str, float]:
    """The table's measured columns from one rank's counts (see the module docstring)."""
    def total(instant: str, category: str, place: str) -> int:
        return sum(b for (c, _, p), b in counts.get(instant, {}).items()
                   if c == category and p == place)

    grads_at = max((i for i in INSTANTS if i in counts),
                   key=lambda i: total(i, "grads", "device") + total(i, "grads", "host"))
    out = {"weights": total("after", "weights", "device"),
           "grads": total(grads_at, "grads", "device"),
           "optimizer": total("after", "optimizer", "device"),
           "host": (total("after", "weights", "host") + total("after", "optimizer", "host")
                    + total(grads_at, "grads", "host")),
           "buffers": max(total(i, "buffers", "device") for i in counts)}
    out["device"] = out["weights"] + out["grads"] + out["optimizer"]
    return out


def header(args: argparse.Namespace) -> str:
    import deepspeed  # optional dependency: imported only when the bench runs

    m = make_cfg(args, "ddp", 2).model
    P = param_count(m)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"data-parallel engines: model dim {m.dim}, {m.n_layers} layers, vocab "
            f"{m.vocab_size}, ffn {m.ffn_dim}, heads {m.n_heads}/{m.n_kv_heads} kv: P = {P:,} "
            f"parameters ({16 * P / MIB:.1f} MiB at 16 B/param); seq_len {args.seq_len}, one "
            f"sequence per rank and step, fp32, one thread per rank, {args.warmup} warm-up + "
            f"{args.steps} timed steps | torch {torch.__version__}, deepspeed "
            f"{deepspeed.__version__}\ncores: {len(os.sched_getaffinity(0))}, load average "
            f"{load}. MiB per rank; meas = measured, form = formula (n = dp).")


COLUMNS = ("weights", "grads", "optimizer", "device", "host")
LEGEND = (
    "form: weights 4P, grads 4P, optimizer 8P, each / n where the engine shards it (FSDP all; "
    "ZeRO-1 optimizer; ZeRO-2 + grads; ZeRO-3 + weights), offloaded ones under host. plan: "
    "lctrain.planning.state.state_bytes_per_rank. weights, optimizer, host: after the step; "
    "grads, buffers: at their largest instant (reduce buckets at nominal size). ms: median step;"
    " * more ranks than cores (time-sliced).")


def print_table_header() -> None:
    groups = "".join(f" {c:^15}" if c != "device" else f" {'device total':^23}"
                     for c in COLUMNS)
    print(f"\n{'':<18}{groups} {'buffers':>9} {'step':>7}")
    print(f"{'engine':<14}{'dp':>2}{'r':>2}"
          + "".join("    meas    form" + ("    plan" if c == "device" else "") for c in COLUMNS)
          + f" {'meas':>9} {'ms':>7}")


def print_rows(name: str, cfg: LctrainConfig, ranks: list[dict], P: int, cores: int) -> None:
    dp = cfg.parallel.dp
    mark = "*" if dp > cores else ""
    want = formula(name, P, dp)
    want["device"] = want["weights"] + want["grads"] + want["optimizer"]
    plan = state_bytes_per_rank(cfg, dp)
    for r, res in enumerate(ranks):
        got = summarize(res["counts"])
        cells = "".join(f" {got[c] / MIB:7.2f} {want[c] / MIB:7.2f}"
                        + (f" {plan / MIB:7.2f}" if c == "device" else "") for c in COLUMNS)
        print(f"{name:<14}{dp:>2}{r:>2}{cells} {got['buffers'] / MIB:9.1f} "
              f"{res['step_s'] * 1e3:7.0f}{mark}", flush=True)


def print_details(name: str, dp: int, res: dict, P: int) -> None:
    """Rank 0's components at each instant, and bytes per parameter at the largest."""
    counts = res["counts"]
    keys = list(dict.fromkeys(k for c in counts.values() for k in c))  # in claim order
    note = (f", {res['persistent']:,} parameters persistent (whole on every rank)"
            if res["persistent"] else "")
    print(f"\n{name} dp={dp}, rank 0{note}: MiB at each instant; B/P = bytes per parameter "
          f"at the largest")
    print(f"  {'category':<10}{'component':<52}{'place':<7}"
          + "".join(f"{i:>9}" for i in INSTANTS) + f"{'B/P':>7}")
    for key in keys:
        values = [counts[i].get(key) if i in counts else None for i in INSTANTS]
        peak = max(v for v in values if v is not None)
        if not peak and key[0] == "other":
            continue
        cells = "".join(f"{'-':>9}" if v is None else f"{v / MIB:9.2f}" for v in values)
        print(f"  {key[0]:<10}{key[1]:<52}{key[2]:<7}{cells}{peak / P:7.2f}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes")
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    p.add_argument("--dim", type=int, default=512, help="model dim (8 heads, ffn 3 x dim)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--details", action=argparse.BooleanOptionalAction, default=True,
                   help="print each engine's components (rank 0, the first dp)")
    args = p.parse_args()
    problems = [f"--{k.replace('_', '-')} must be >= 1; got {v}" for k, v in [
        ("dim", args.dim), ("vocab", args.vocab), ("layers", args.layers),
        ("seq_len", args.seq_len), ("steps", args.steps), ("warmup", args.warmup)] if v < 1]
    if min(args.dp) < 2:
        problems.append(f"--dp sizes must be >= 2 (one rank has no data parallelism); got "
                        f"{args.dp}")
    if args.dim % 8:
        problems.append(f"--dim must be a multiple of the 8 heads; got {args.dim}")
    if problems:
        p.error("; ".join(problems))
    return args


def main() -> None:
    args = parse_args()
    start, cores = time.perf_counter(), len(os.sched_getaffinity(0))
    print(header(args), flush=True)
    P = param_count(make_cfg(args, "ddp", 2).model)
    results: dict[tuple[str, int], list[dict]] = {}
    print_table_header()
    for dp in args.dp:
        for name in args.engines:
            cfg = make_cfg(args, name, dp)
            problems = validate(cfg, dp)
            if problems:
                print(f"{name:<14}{dp:>2}  skipped: {'; '.join(problems)}", flush=True)
                continue
            results[name, dp] = run_ranks(run_engine, dp, (cfg, args.warmup, args.steps),
                                          timeout_s=600)
            print_rows(name, cfg, results[name, dp], P, cores)
    print(LEGEND)
    if args.details:
        dp = args.dp[0]
        for name in args.engines:
            if (name, dp) in results:
                print_details(name, dp, results[name, dp][0], P)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
