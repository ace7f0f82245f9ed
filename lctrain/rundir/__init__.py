"""The run directory's room: the names of the files a run keeps in its directory and where its
checkpoints go, in one place for every command and the training loop; how its files are written
whole or not at all (`files`); the one-job lock (`lock`); and the readers of what a run leaves
(`metrics`, `checkpoints`, `progress`). Pure paths and files: it imports only lctrain.config
(for ConfigError) and no torch, so the commands that only read a run (`lctrain status`,
`lctrain plot`) use it without the training stack.

    RUN_DIR/config.yaml      the resolved config (written whole or not at all)
    RUN_DIR/metrics.jsonl    one JSON row per logged step
    RUN_DIR/STOP             a request to stop after the current step (`lctrain stop`)
    RUN_DIR/slurm_jobs       the Slurm jobs `lctrain submit` started for the run
    RUN_DIR/checkpoints/     the checkpoints, unless checkpoint.dir puts them elsewhere
    RUN_DIR/.lctrain.lock    who holds the run dir (`lock`)
    RUN_DIR/.progress/       each rank's progress record (`progress`)
    RUN_DIR/stall-report.txt the last stall report
    RUN_DIR/command.json     the words of the `lctrain train` command that last ran in it (the
                             command that resumes the run is made from them)
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
STOP = "STOP"
JOBS = "slurm_jobs"
CHECKPOINTS = "checkpoints"
LOCK = ".lctrain.lock"
PROGRESS = ".progress"
STALL_REPORT = "stall-report.txt"
COMMAND = "command.json"
PLACED = ("hydra.run.dir=", "checkpoint.resume=")
"""Overrides the command that resumes a run sets itself."""


@dataclass(frozen=True)
class RunDir:
    """The files of one run directory."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def stop(self) -> Path:
        return self.path / STOP

    @property
    def jobs(self) -> Path:
        return self.path / JOBS

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def progress(self) -> Path:
        return self.path / PROGRESS

    @property
    def stall_report(self) -> Path:
        return self.path / STALL_REPORT

    @property
    def command(self) -> Path:
        return self.path / COMMAND

    def resume_command(self) -> str:
        """The command that resumes this run in this directory from its newest complete
        checkpoint: the overrides of the command that ran in it, with hydra.run.dir (this
        directory, absolute) and checkpoint.resume=auto."""
        words = json.loads(self.command.read_text()) if self.command.is_file() else [
            "<the overrides that started it>"]
        kept = [w for w in words if not w.startswith(PLACED)]
        return shlex.join(["lctrain", "train", *kept, f"hydra.run.dir={self.path.resolve()}",
                           "checkpoint.resume=auto"])

    def checkpoints(self, checkpoint_dir: str | None = None) -> Path:
        """Where the run's checkpoints go: checkpoint.dir when set, else RUN_DIR/checkpoints."""
        return Path(checkpoint_dir) if checkpoint_dir else self.path / CHECKPOINTS
