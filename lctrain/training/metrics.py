"""Rank-0 console (progress bar or plain lines), metrics.jsonl in the run dir, optional W&B."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from lctrain.config import LoggingConfig


class MetricsLogger:
    """Decides when to log (`should_log`) and writes every logged step everywhere (rank 0 only)."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, rank: int, total_steps: int,
                 config_dict: dict | None = None):
        self.cfg, self.rank, self.total_steps = cfg, rank, total_steps
        self.enabled = rank == 0
        self.path = run_dir / "metrics.jsonl"
        self._file = self._progress = self._task = self._wandb = None
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self.console = Console(file=sys.stdout, soft_wrap=True)
        if cfg.progress and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=self.console)
            self._task = self._progress.add_task("train", total=total_steps, status="")
            self._progress.start()
        if cfg.wandb and cfg.wandb_mode != "disabled":
            import wandb  # lazy: heavy import, optional at run time

            self._wandb = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode,
                                     dir=str(run_dir), config=config_dict)

    def should_log(self, step: int) -> bool:
        """Step is 1-based; the last step is always logged."""
        return step % self.cfg.log_every == 0 or step == self.total_steps

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics, "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        status = (f"step {step}/{self.total_steps}  loss {metrics['loss']:.4f}  "
                  f"lr {metrics['lr']:.2e}  gnorm {metrics['grad_norm']:.3f}  "
                  f"{metrics['tokens_per_sec']:,.0f} tok/s")
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)
        else:
            self.console.print(status, highlight=False)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def info(self, message: str) -> None:
        if self.enabled:
            (self._progress.console if self._progress else self.console).print(message,
                                                                                highlight=False)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()
