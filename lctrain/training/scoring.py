"""`lctrain eval` on one rank: the weights of a checkpoint (checkpoint.load) or of a Hugging Face
model (model.init_from) on the layout of the config, scored once by the evals training runs
every eval.every steps (the retrieval tasks, the validation loss and its position bands), with
no optimizer and no training step. Rank 0 prints the table and writes RUN_DIR/metrics.jsonl (one
row, at the checkpoint's step: `lctrain plot` reads it), RUN_DIR/eval.json and W&B's log.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from lctrain.config import LctrainConfig
from lctrain.config.resolved import as_dict, to_yaml
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.rundir.files import write_atomic
from lctrain.training.checkpoint import Checkpointer
from lctrain.training.evals import Evaluator, format_table
from lctrain.training.metrics import MetricsLogger

EVAL_FILE = "eval.json"
"""What `lctrain eval` scored: {"weights": where from, "step": int, "results": {key: value},
"samples": every RULER-style example (task, length, prompt ids, answers, generated ids, score),
so that another harness can check the scoring and the generation}."""


def evaluate(cfg: LctrainConfig, run_dir: str | os.PathLike) -> dict[str, float]:
    """Score the weights `cfg` names on this rank's share of the layout; returns the results
    (identical on every rank)."""
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, every=1))  # score now
    rt = setup_distributed(cfg)
    run_dir = Path(run_dir)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, rt)  # model.init_from's weights, or train.seed's
    metrics = MetricsLogger(cfg.logging, run_dir, rt.rank, 1, as_dict(cfg))
    checkpointer = None
    try:
        step, weights = 0, cfg.model.init_from
        if cfg.checkpoint.load is not None:
            checkpointer = Checkpointer(cfg, rt, run_dir, to_yaml(cfg), metrics.info)
            step, weights = checkpointer.load_weights(Path(cfg.checkpoint.load), model), \
                cfg.checkpoint.load
        evaluator = Evaluator(cfg, rt)
        results = evaluator.run(model)
        metrics.info(f"lctrain: evaluated {weights} (step {step}) on {rt.world_size} rank(s)")
        for line in format_table(results, cfg.eval.tasks, cfg.eval.lengths or [cfg.train.seq_len]):
            metrics.info(line)
        metrics.record(step, results)
        if rt.rank == 0:
            write_atomic(run_dir / EVAL_FILE, json.dumps(
                {"weights": str(weights), "step": step, "results": results,
                 "samples": evaluator.samples}, indent=1) + "\n")
    finally:
        if checkpointer is not None:
            checkpointer.close()
        metrics.close()
    return results
