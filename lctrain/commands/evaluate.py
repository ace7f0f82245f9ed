"""`lctrain eval`: score trained weights without training, on the layout of the config (any
TP/CP/PP, so a 256K context is scored where it trained), with the evals training runs every
eval.every steps: the retrieval tasks (eval.tasks) and, with validation data (data.val_fraction
or eval.val_data), the validation loss and its position bands.

The weights: a checkpoint of a run (checkpoint.load=RUN_DIR/checkpoints/step-N, saved under any
layout and engine), or a Hugging Face model (model.init_from=DIR). The ranks start as `lctrain
train`'s do (local ranks, torchrun or srun); the results go to the console, to the run dir's
metrics.jsonl and eval.json (`lctrain.training.scoring`) and to W&B when logging.wandb is on.
The run dir of a checkpoint's scores is that checkpoint's run (unless hydra.run.dir is set).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lctrain.commands import CommandArgs
from lctrain.commands.train import run_on_ranks
from lctrain.config import LctrainConfig
from lctrain.config.eval_rules import eval_problems
from lctrain.rundir import RunDir
from lctrain.training.scoring import evaluate


def scoring_problems(cfg: LctrainConfig) -> list[str]:
    """What `lctrain eval` needs beyond a valid config: weights to score, and something to
    score them on."""
    problems = []
    if cfg.checkpoint.load is None and cfg.model.init_from is None:
        problems.append("lctrain eval scores trained weights, and none are named: set "
                        "checkpoint.load=RUN_DIR/checkpoints/step-N (a checkpoint of lctrain "
                        "train) or model.init_from=DIR (a Hugging Face model)")
    if not cfg.eval.every:  # validation checks the evals only of runs that evaluate
        problems += eval_problems(dataclasses.replace(
            cfg, eval=dataclasses.replace(cfg.eval, every=1)))
    return problems


def checkpoint_run_dir(args: CommandArgs) -> Path | None:
    """The run dir of the checkpoint checkpoint.load names (RUN_DIR/checkpoints/step-N, RUN_DIR
    holding config.yaml), where the scores go unless the command line sets hydra.run.dir."""
    load = args.composed.cfg.checkpoint.load
    if load is None or any(w.startswith("hydra.run.dir=") for w in args.words):
        return None
    run_dir = Path(load).resolve().parent.parent
    room = RunDir(run_dir)
    if not room.config.is_file() or room.checkpoints() != Path(load).resolve().parent:
        return None
    return run_dir


def run(args: CommandArgs) -> int:
    beside = checkpoint_run_dir(args)
    if beside is not None:  # eval.json and the metrics row beside the run's own
        args = dataclasses.replace(args, composed=dataclasses.replace(args.composed,
                                                                      run_dir=beside))
    return run_on_ranks(args, evaluate, scoring_problems)
