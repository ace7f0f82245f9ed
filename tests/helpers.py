"""Shared test helpers: tiny configs, the multi-rank runner (many cases per spawn) and the
command line run in-process."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
from torch import nn

from lctrain.config import LctrainConfig, ModelConfig
from lctrain.models.registry import new_model
from lctrain.parallel.launch import run_ranks

HEADS_8 = {"vocab_size": 128, "dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4,
           "ffn_dim": 96}
"""tiny_config's model with 8 query and 4 KV heads: tp=4, tp2 x Ulysses 2 and tp4 x Ulysses 2
(KV replicated x2) all split its heads."""


def tiny_config(**sections) -> LctrainConfig:
    """A CPU-fast config; `sections` maps a section name to a dict of overrides."""
    cfg = LctrainConfig()
    cfg.model = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_dim=96)
    cfg.train.seq_len, cfg.train.global_batch, cfg.train.steps = 32, 4, 3
    cfg.data.doc_len_min, cfg.data.doc_len_max = 8, 24
    cfg.optim.warmup_steps = 1
    cfg.logging.progress = False
    for section, values in sections.items():
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **values))
    return cfg


def with_overrides(cfg: LctrainConfig, **sections) -> LctrainConfig:
    """A copy of cfg with some fields of some sections replaced, as tiny_config takes them:
    with_overrides(cfg, checkpoint={"resume": "auto"})."""
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **values)
                                       for name, values in sections.items()})


def dp2_config(steps: int = 6, **sections) -> LctrainConfig:
    """tiny_config on dp=2 ranks, 4 sequences per step one at a time, a checkpoint every 2
    steps: the run the checkpoint and fault tests interrupt and resume. `sections` are merged
    into those settings (checkpoint={"every": 0} replaces only the interval)."""
    base = {"train": {"steps": steps, "global_batch": 4, "micro_batch": 1},
            "parallel": {"dp": 2}, "checkpoint": {"every": 2}}
    return tiny_config(**{name: {**base.get(name, {}), **sections.get(name, {})}
                          for name in {**base, **sections}})


def single_process(cfg: LctrainConfig) -> LctrainConfig:
    """cfg laid out on one rank: the reference run every layout is compared with."""
    return with_overrides(cfg, parallel={"pp": 1, "tp": 1, "sp": False, "cp": 1, "dp": -1})


def on_ranks(fn, nproc: int, *args, timeout_s: float = 120.0):
    """fn(*args) on nproc forked gloo ranks, one thread each; results in rank order."""
    return run_ranks(fn, nproc, args, start_method="fork", threads=1, backend="gloo",
                     timeout_s=timeout_s)


def train_each(cfgs: dict[str, LctrainConfig], root: str) -> dict[str, list[dict]]:
    """On this rank: train(cfg, root/name) for every (name, cfg) in order, in one process group
    (a later run may load an earlier one's checkpoint); {name: this rank's history}."""
    from lctrain.training.loop import train

    return {name: train(cfg, f"{root}/{name}") for name, cfg in cfgs.items()}


def train_on_ranks(runs: dict[str, tuple[int, LctrainConfig]], root: str,
                   timeout_s: float = 300.0) -> dict[str, list[list[dict]]]:
    """Every run (name -> (world size, config)) trained in root/name, one spawn per world size
    for all of its runs, world sizes in the order they first appear and each one's runs in the
    order given (a run may load a checkpoint of an earlier run of its world size);
    {name: every rank's history}."""
    by_world: dict[int, dict[str, LctrainConfig]] = defaultdict(dict)
    for name, (world, cfg) in runs.items():
        by_world[world][name] = cfg
    out: dict[str, list[list[dict]]] = {}
    for world, cfgs in by_world.items():
        per_rank = on_ranks(train_each, world, cfgs, root, timeout_s=timeout_s)
        out.update({name: [rank[name] for rank in per_rank] for name in cfgs})
    return {name: out[name] for name in runs}


def reference_model(cfg: LctrainConfig) -> nn.Module:
    """The unsharded single-process model with the initial weights of train.seed: the reference
    every layout is compared with."""
    model = new_model(cfg.model)
    model.init_weights(cfg.train.seed)
    return model


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`lctrain ARGV` in this process: (exit code, stdout, stderr). The command must end with
    SystemExit, as the installed command does."""
    from lctrain import cli

    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    captured = capsys.readouterr()
    return done.value.code, captured.out, captured.err


def exit_code(argv: list[str]) -> int:
    """The exit code of `lctrain ARGV` run in this process (its output left to pytest)."""
    from lctrain import cli

    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    return done.value.code
