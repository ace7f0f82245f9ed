"""Shared test helpers: tiny configs and the multi-rank runner."""

from __future__ import annotations

import dataclasses

from lctrain.config import LctrainConfig, ModelConfig
from lctrain.models.llama import Llama
from lctrain.parallel.launch import run_ranks


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


def on_ranks(fn, nproc: int, *args, timeout_s: float = 120.0):
    """fn(*args) on nproc forked gloo ranks, one thread each; results in rank order."""
    return run_ranks(fn, nproc, args, start_method="fork", threads=1, backend="gloo",
                     timeout_s=timeout_s)


def reference_model(cfg: LctrainConfig) -> Llama:
    """The unsharded single-process model with the initial weights of train.seed: the reference
    every layout is compared with."""
    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    return model
