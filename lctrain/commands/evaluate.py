"""`lctrain eval`: score trained weights without training, on the layout of the config (any
TP/CP/PP, so a 256K context is scored where it trained), with the evals training runs every
eval.every steps: the retrieval tasks (eval.tasks) and, with validation data (data.val_fraction
or eval.val_data), the validation loss and its position bands.

The weights: a checkpoint of a run (checkpoint.load=RUN_DIR/checkpoints/step-N, saved under any
layout and engine), or a Hugging Face model (model.init_from=DIR). The ranks start as `lctrain
train`'s do (local ranks, torchrun or srun); the results go to the console, to the run dir's
metrics.jsonl and eval.json (`lctrain.training.scoring`) and to W&B when logging.wandb is on.
"""

from __future__ import annotations

from lctrain.commands import CommandArgs
from lctrain.commands.train import run_on_ranks
from lctrain.config import LctrainConfig
from lctrain.config.eval_rules import has_validation
from lctrain.training.scoring import evaluate


def scoring_problems(cfg: LctrainConfig) -> list[str]:
    """What `lctrain eval` needs beyond a valid config: weights to score, and something to
    score them on."""
    problems = []
    if cfg.checkpoint.load is None and cfg.model.init_from is None:
        problems.append("lctrain eval scores trained weights, and none are named: set "
                        "checkpoint.load=RUN_DIR/checkpoints/step-N (a checkpoint of lctrain "
                        "train) or model.init_from=DIR (a Hugging Face model)")
    if not cfg.eval.tasks and not has_validation(cfg):
        problems.append("lctrain eval has nothing to score: eval.tasks is empty and no "
                        "validation data is set; try eval.tasks=[passkey] or "
                        "data.val_fraction=0.01 (or eval.val_data=DIR)")
    return problems


def run(args: CommandArgs) -> int:
    return run_on_ranks(args, evaluate, scoring_problems)
