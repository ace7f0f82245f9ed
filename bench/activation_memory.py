"""Activation memory per layout and checkpointing mode: measured vs formula, and the longest
sequence the tiny model trains under a memory cap per rank. Prints two tables.

    python bench/activation_memory.py [--seq-len 256] [--cap-gib 1.0]

Measured: storages a block leaves alive for the backward (lctrain.memory.measure_activations,
gloo ranks on the CPU). Formula: lctrain.memory.activation_formula. The longest sequence uses the
formula (validated by the first table) for the blocks, plus a measured per-token cost of the
rest (embedding output, final norm, logits, loss), divided by cp and, with SP, by tp (an
approximation: the logits are vocab-sharded in every TP layout), and the fp32 weights, gradients
and AdamW moments sharded over all ranks (FSDP over dp x cp, TP).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.config import LctrainConfig, ModelConfig  # noqa: E402
from lctrain.config.validation import validate  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.parallel.memory import measure_block_activations
from lctrain.planning.memory import (
    activation_formula,  # noqa: E402
    param_count,  # noqa: E402
)

LAYOUTS = [  # (world, parallel overrides)
    (1, {}), (2, {"tp": 2}), (2, {"tp": 2, "sp": True}),
    (2, {"cp": 2}), (4, {"cp": 4}), (4, {"tp": 2, "sp": True, "cp": 2}),
    (4, {"cp": 4, "attention": "ulysses"}), (4, {"cp": 4, "attention": "allgather"}),
    (8, {"tp": 2, "sp": True, "cp": 4, "attention": "usp", "ulysses_degree": 2}),
]
MODES = ("none", "selective", "full")
BATCH = 1


def make_cfg(par: dict, mode: str, seq_len: int) -> LctrainConfig:
    cfg = LctrainConfig(model=ModelConfig())  # the tiny preset's shape
    for key, value in par.items():
        setattr(cfg.parallel, key, value)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.micro_batch = seq_len, BATCH, BATCH
    cfg.train.activation_checkpointing = mode
    return cfg


def _measure(cfgs: list[LctrainConfig]) -> list[float]:
    return [measure_block_activations(cfg, BATCH) for cfg in cfgs]


def _other_per_token(cfg: LctrainConfig) -> float:
    """Measured bytes per local token outside the blocks (embedding, norm, logits, loss)."""
    import torch
    import torch.nn.functional as F

    from lctrain.models.llama import Llama
    from lctrain.parallel.memory import measure_activations

    model = Llama(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len + 1))
    per_layer = measure_activations(
        model, lambda: F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[0, 1:]))
    return per_layer["other"] / cfg.train.seq_len


def longest_sequence(par: dict, world: int, mode: str, cap: float, other: float) -> int:
    """Largest valid seq_len whose predicted per-rank memory fits `cap` bytes."""
    cfg = make_cfg(par, mode, 1024)
    tp, cp = par.get("tp", 1), par.get("cp", 1)
    static = 16 * param_count(cfg.model) / world  # fp32 weights, grads, 2 moments, fully sharded

    def total(seq: int) -> float:
        c = make_cfg(par, mode, seq)
        return (static + c.model.n_layers * activation_formula(c, world, BATCH)
                + other * seq / cp / (tp if par.get("sp") else 1))

    step = 64 * cp * tp
    lo, hi = step, step
    while total(hi) <= cap:
        lo, hi = hi, hi * 2
    while hi - lo > step:  # bisection on multiples of `step`
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if total(mid) <= cap else (lo, mid)
    assert validate(make_cfg(par, mode, lo), world) == [], (par, lo)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--cap-gib", type=float, default=1.0)
    args = ap.parse_args()
    print(f"## bytes one block keeps for the backward, per rank (tiny model, S={args.seq_len}, "
          f"B={BATCH}, fp32): measured / formula")
    print(f"{'layout':<46} " + " ".join(f"{m:>22}" for m in MODES))
    for world, par in LAYOUTS:
        cfgs = [make_cfg(par, mode, args.seq_len) for mode in MODES]
        problems = validate(cfgs[0], world)
        assert not problems, (par, problems)
        got = run_ranks(_measure, world, (cfgs,), timeout_s=600)[0]
        cells = [f"{g:>10,.0f} / {activation_formula(c, world, BATCH):>9,.0f}"
                 for g, c in zip(got, cfgs)]
        print(f"{str(par) or 'single process':<46} " + " ".join(f"{c:>22}" for c in cells))
    other = _other_per_token(make_cfg({}, "none", args.seq_len))
    cap = args.cap_gib * 2**30
    print(f"\n## longest trainable sequence, tiny model, {args.cap_gib:g} GiB per rank "
          f"(formula + measured {other:,.0f} B/token outside the blocks + sharded fp32 states)")
    print(f"{'layout':<46} " + " ".join(f"{m:>12}" for m in MODES))
    for world, par in LAYOUTS:
        row = [longest_sequence(par, world, mode, cap, other) for mode in MODES]
        print(f"{str(par) or 'single process':<46} " + " ".join(f"{s:>12,}" for s in row))


if __name__ == "__main__":
    main()
