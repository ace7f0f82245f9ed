"""What `lctrain <command>` runs: one module per command (train, eval as evaluate, plan with
plan_trace and calibrate for `plan --trace` and `plan --calibrate`, submit, preprocess, keys,
status, plot, and job, which the batch script runs on a Slurm job's first node), each with
`run(args: CommandArgs) -> exit code`; CommandArgs, what `lctrain.cli` hands each one, is
defined here. What every command does before it acts is `lctrain.prepare`; the run dir's lock is
`lctrain.rundir.lock`. Commands raise ConfigError for anything the user must fix and
RunDirLocked for a run dir in use; `lctrain.cli` prints them (exit 2 and 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # job, run by the batch script before torch, imports only the standard library
    from lctrain.config.compose import Composed


@dataclass(frozen=True)
class CommandArgs:
    """One command line, parsed: its words and flags, and the composed configuration when the
    command takes overrides."""

    words: list[str]
    """The words after the command that are not flags: Hydra overrides, or the section names
    and run dirs that `keys`, `status` and `plot` take."""
    flags: frozenset[str]
    """The `--flags` given, each as typed (`--out=DIR` included); the CLI allowed them."""
    composed: Composed | None = None
    """The words composed and model.* resolved (commands that take overrides); None for the
    commands that take names or paths, and for `submit --multirun`, which composes each
    combination itself."""
