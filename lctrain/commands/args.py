"""CommandArgs: what `lctrain.cli` hands every command's `run(args) -> exit code`."""

from __future__ import annotations

from dataclasses import dataclass

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
