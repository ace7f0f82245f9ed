"""Activation memory per rank: what the forward keeps (measured vs formula), the peak of a whole
forward + backward (measured vs the plan's estimate), the longest sequence the tiny model trains
under a memory cap per feature combination, and `lctrain plan`'s per-rank memory for the 256K
recipe. Prints four tables.

    python bench/activation_memory.py [--cap-gib 1.0] [--chunk 256]

Kept: storages a training forward leaves alive for the backward
(lctrain.tracing.measure.measure_activations, gloo ranks on the CPU) against
lctrain.planning.activations' block and head formulas. Peak: the most bytes alive at once in
storages the step's ops created (measure_peak): activations, gradients, the backward's
temporaries (weights and AdamW moments exist before and are added as 12 bytes per parameter).
The longest sequence fits a line to the measured peaks at two lengths (every term grows linearly
with the sequence at a fixed chunk size), checks it at a third, and solves for the cap. Offload
is measured as a GPU runs it: the tensors autograd saves outside the checkpointed blocks are
copied off the device (not counted) and copied back for the backward (counted).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.commands.plan import plan_world_size  # noqa: E402
from lctrain.config import LctrainConfig, ModelConfig  # noqa: E402
from lctrain.config.compose import compose  # noqa: E402
from lctrain.config.validation import validate  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.planning.activations import (  # noqa: E402
    activation_formula,
    head_activation_formula,
    planning_bytes,
)
from lctrain.planning.estimate import build_plan  # noqa: E402
from lctrain.planning.state import local_params  # noqa: E402
from lctrain.tracing.measure import (  # noqa: E402
    build_measured_model,
    measure_activations,
    measure_peak,
)

MIB = 2**20
LAYOUTS = [  # (world, parallel overrides)
    (1, {}), (2, {"tp": 2, "sp": True}), (2, {"cp": 2}), (4, {"tp": 2, "sp": True, "cp": 2}),
    (4, {"cp": 4, "attention": "ulysses"}), (4, {"cp": 4, "attention": "allgather"}),
    (4, {"cp": 4, "attention": "usp", "ulysses_degree": 2}),
]
MODES = ("none", "selective", "full")


def features(chunk: int) -> dict[str, dict]:
    """Feature combinations, each on top of the previous one (full checkpointing throughout
    but for the first two rows)."""
    combos = {"none": {"activation_checkpointing": "none"},
              "selective": {"activation_checkpointing": "selective"},
              "full (today's best)": {"activation_checkpointing": "full"}}
    combos["+ loss_chunk"] = {**combos["full (today's best)"], "loss_chunk": chunk}
    combos["+ mlp_chunk"] = {**combos["+ loss_chunk"], "mlp_chunk": chunk}
    combos["+ bf16"] = {**combos["+ mlp_chunk"], "dtype": "bf16"}
    combos["+ offload"] = {**combos["+ bf16"], "offload_activations": True}
    return combos


def make_cfg(par: dict, train: dict, seq_len: int) -> LctrainConfig:
    cfg = LctrainConfig(model=ModelConfig())  # the tiny preset's shape
    for key, value in par.items():
        setattr(cfg.parallel, key, value)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.micro_batch = seq_len, 1, 1
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _kept(cfgs: list[LctrainConfig]) -> list[dict]:
    return [measure_activations(*build_measured_model(cfg, 1)) for cfg in cfgs]


def kept_table(seq_len: int) -> None:
    print(f"## bytes kept for the backward per rank, tiny model, S={seq_len}, B=1: measured / "
          f"formula, one block | rest of the model (head, embedding-side, call plans)")
    for dtype in ("fp32", "bf16"):
        print(f"\n{dtype:<44} " + " ".join(f"{m:>30}" for m in MODES))
        for world, par in LAYOUTS:
            cfgs = [make_cfg(par, {"activation_checkpointing": m, "dtype": dtype}, seq_len)
                    for m in MODES]
            assert not validate(cfgs[0], world), par
            cells = []
            for cfg, got in zip(cfgs, run_ranks(_kept, world, (cfgs,), timeout_s=600)[0]):
                block = activation_formula(cfg, world, 1)
                rest = head_activation_formula(cfg, world, 1) + planning_bytes(cfg, 1)
                last = got.pop(str(cfg.model.n_layers - 1))
                got_rest = sum(got.values()) - (cfg.model.n_layers - 1) * last
                cells.append(f"{last / block:.3f}x {block:>9,.0f} | {got_rest / rest:.3f}x")
            print(f"{str(par) or 'single process':<44} " + " ".join(f"{c:>30}" for c in cells))


class _Offloaded(torch.autograd.graph.saved_tensors_hooks):
    """What save_on_cpu does on a GPU, on the CPU: a saved tensor becomes a copy that the peak
    tracker does not see (host memory) and is copied back, seen, for the backward."""

    def __init__(self):
        from torch.utils._python_dispatch import _disable_current_modes

        def pack(t):
            with _disable_current_modes():
                return t.clone()

        super().__init__(pack, lambda host: host.clone())


def _peak(par: dict, train: dict, seq: int) -> int:
    offload = train.get("offload_activations", False)
    cfg = make_cfg(par, {**train, "offload_activations": False}, seq)
    model, run_forward = build_measured_model(cfg, 1)

    def step():
        with _Offloaded() if offload else contextlib.nullcontext():
            loss = run_forward()
        loss.backward()

    return measure_peak(step, model)


def _peaks(par: dict, train: dict, seq_lens: list[int]) -> list[int]:
    return [_peak(par, train, seq) for seq in seq_lens]


def _states(cfg: LctrainConfig, world: int) -> float:
    """fp32 weights and AdamW moments (gradients are measured), sharded over every rank."""
    return 12 * sum(local_params(cfg)) / world


def peak_tables(cap: float, chunk: int) -> None:
    combos = features(chunk)
    fit = [4096, 8192]
    check = 16384
    print(f"\n## peak bytes per rank of a forward + backward, tiny model, single process, "
          f"B=1 (chunks of {chunk} tokens): measured vs lctrain plan's estimate")
    print(f"{'features':<22} {'S':>6} {'measured MiB':>13} {'plan MiB':>10} {'plan/measured':>14}")
    peaks = {}
    for name, train in combos.items():
        peaks[name] = run_ranks(_peaks, 1, ({}, train, [*fit, check]), timeout_s=600)[0]
        cfg = make_cfg({}, train, check)
        mem = build_plan(cfg, 1)["memory_per_rank"]["bytes"]
        plan = mem["modelled"] - sum(mem[k] for k in (  # what the measurement sees, and
            "weights", "gradients", "optimizer_state", "attention_buffers")) + 4 * sum(
            local_params(cfg))  # the fp32 gradients, which it includes
        print(f"{name:<22} {check:>6} {peaks[name][-1] / MIB:>13.2f} {plan / MIB:>10.2f} "
              f"{plan / peaks[name][-1]:>14.3f}")

    print(f"\n## longest trainable sequence, tiny model, single process, {cap / 2**30:g} GiB per "
          f"rank: measured peak (line through S={fit[0]}, {fit[1]}; error at S={check}) + fp32 "
          f"weights and AdamW")
    print(f"{'features':<22} {'longest S':>12} {'vs full':>8} {'line error':>11} "
          f"{'kept-only S':>12}")
    base = None
    for name, train in combos.items():
        (p1, p2, p3) = peaks[name]
        slope = (p2 - p1) / (fit[1] - fit[0])
        offset = p1 - slope * fit[0] + _states(make_cfg({}, train, fit[0]), 1)
        longest = int((cap - offset) / slope) // 64 * 64
        error = (offset - _states(make_cfg({}, train, fit[0]), 1) + slope * check) / p3 - 1
        kept_only = _kept_only_longest(train, cap)
        base = longest if name.startswith("full") else base
        ratio = f"{longest / base:.2f}x" if base else ""
        kept_text = "no limit" if kept_only is None else f"{kept_only:,}"
        print(f"{name:<22} {longest:>12,} {ratio:>8} {error:>+10.1%} {kept_text:>12}")


def _kept_only_longest(train: dict, cap: float) -> int | None:
    """The previous version of this table: the kept bytes alone (formula) plus states (None:
    no limit, as with offload nothing is kept on the device)."""
    def total(seq: int) -> float:
        cfg = make_cfg({}, train, seq)
        kept = (cfg.model.n_layers * activation_formula(cfg, 1, 1)
                + head_activation_formula(cfg, 1, 1))
        on_device = 0 if train.get("offload_activations") else kept
        return on_device + 16 * sum(local_params(cfg))

    lo, hi = 64, 128
    while total(hi) <= cap and hi < 2**40:
        lo, hi = hi, hi * 2
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64
        lo, hi = (mid, hi) if total(mid) <= cap else (lo, mid)
    return lo if hi < 2**40 else None


# the recipe's layout on its preset model: the checkpoint and corpus it requires given as null,
# synthetic data (the plan's memory does not depend on them)
LAYOUT_ONLY = ["model.init_from=null", "model.hf_overrides=[]", "data.source=synthetic",
               "data.path=null", "data.tokenizer=null"]


def recipe_table(chunk: int) -> None:
    print("\n## lctrain plan per rank, recipes/llama-256k.yaml (GiB)")
    keys = ("states", "fsdp_gathered_weights", "activations_kept", "activations_on_host",
            "backward_working_set", "allocator_allowance", "total")
    heads = ("states", "gathered", "kept", "on host", "working", "allowance", "total")
    print(f"{'overrides':<82} " + " ".join(f"{h:>9}" for h in heads))
    rows = [[], ["train.activation_checkpointing=full"],
            ["train.activation_checkpointing=full", f"train.loss_chunk={chunk * 16}"],
            ["train.activation_checkpointing=full", f"train.loss_chunk={chunk * 16}",
             f"train.mlp_chunk={chunk * 16}"],
            ["train.activation_checkpointing=full", f"train.loss_chunk={chunk * 16}",
             f"train.mlp_chunk={chunk * 16}", "train.offload_activations=true"]]
    for overrides in rows:
        cfg = compose(["+recipe=llama-256k", *LAYOUT_ONLY, *overrides]).cfg
        world = plan_world_size(cfg)
        assert not validate(cfg, world), overrides
        plan = build_plan(cfg, world)
        mem = plan["memory_gib"]
        mem["states"] = mem["weights"] + mem["gradients"] + mem["optimizer_state"]
        mem["activations_on_host"] = plan["memory_per_rank"]["activations_on_host_bytes"] / 2**30
        name = " ".join(o.split(".")[-1] for o in overrides) or "recipe as shipped"
        print(f"{name:<82} " + " ".join(f"{mem[k]:>9.2f}" for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256, help="for the kept-bytes table")
    ap.add_argument("--cap-gib", type=float, default=1.0)
    ap.add_argument("--chunk", type=int, default=256, help="loss_chunk and mlp_chunk tokens")
    args = ap.parse_args()
    kept_table(args.seq_len)
    peak_tables(args.cap_gib * 2**30, args.chunk)
    recipe_table(args.chunk)


if __name__ == "__main__":
    main()
