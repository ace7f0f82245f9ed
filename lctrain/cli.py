"""`lctrain <command> [overrides...] [flags]`: parse the command line, compose the configuration,
run the command, and turn a ConfigError into its message and exit code 2 (the only place that
does; a run dir held by a live job, RunDirLocked, is exit code 3).

Every command is one entry of COMMANDS: the module whose `run(CommandArgs) -> int` it runs, its
summary and its flags.

Composition uses Hydra's compose API (not @hydra.main) so that every configuration error, including
Hydra's own (bad types, unknown groups), ends with exit code 2 and a readable message, and so
that nothing (run dir, process group, child process) exists before validation passes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from lctrain.commands import CommandArgs
from lctrain.config import ConfigError
from lctrain.config.compose import compose
from lctrain.config.paths import recipe_names
from lctrain.config.resolved import to_yaml
from lctrain.prepare.init_from import resolve_model
from lctrain.rundir.lock import RunDirLocked


@dataclass(frozen=True)
class Command:
    """One `lctrain <command>`: the module whose `run(CommandArgs) -> int` does the work,
    imported only when the command runs (train and plan load torch, which takes seconds, and
    preprocess must start without it)."""

    module: str
    summary: str
    """What it does, for the usage text."""
    flags: frozenset[str] = frozenset()
    """The flags it takes (--help aside)."""
    composes: bool = True
    """Its words are overrides, composed (and --cfg printed) before it runs; keys, status and
    plot take names or paths instead."""
    routes: Mapping[str, str] = field(default_factory=dict)
    """flag -> the module that runs instead, on the same composed configuration."""
    composes_itself: frozenset[str] = frozenset()
    """Flags with which the module composes the overrides itself (--cfg included)."""


COMMANDS = {
    "train": Command("lctrain.commands.train",
                     "validate, then train (local ranks, torchrun or srun)", frozenset({"--cfg"})),
    "eval": Command("lctrain.commands.evaluate",
                    "score a checkpoint (checkpoint.load) or a Hugging Face model "
                    "(model.init_from) on the layout, with the evals training runs, without "
                    "training", frozenset({"--cfg"})),
    "plan": Command("lctrain.commands.plan",
                    "validate and print the layout, per-rank shapes, memory and traffic "
                    "(--calibrate: measure this machine's matmul rate and gloo bandwidth into "
                    "plan.calibration; --trace: also run one training step of each rank role "
                    "on fake tensors at full size and print its peak memory)",
                    frozenset({"--json", "--cfg", "--calibrate", "--trace"}),
                    routes={"--calibrate": "lctrain.commands.calibrate"}),  # prints no plan
    "submit": Command("lctrain.commands.submit",
                      "render the sbatch script for slurm.* and submit it (--multirun: one job "
                      "per combination of comma-separated values)",
                      frozenset({"--dry-run", "--cfg", "--multirun"}),
                      composes_itself=frozenset({"--multirun"})),  # one config per combination
    "preprocess": Command("lctrain.commands.preprocess",
                          "tokenize data.path with data.tokenizer into preprocess.output, for "
                          "data.source=tokens", frozenset({"--cfg"})),
    "keys": Command("lctrain.commands.keys",
                    "list every key (or those of the SECTIONs given) with its type, default, "
                    "allowed values and meaning", composes=False),
    "status": Command("lctrain.commands.status",
                      "RUN_DIR...: job state, last step, loss, tokens/s, ETA and newest "
                      "checkpoint", composes=False),
    "plot": Command("lctrain.commands.plot",
                    "RUN_DIR...: PNGs of loss, tokens/s, MFU, memory and eval accuracy against "
                    "step, runs overlaid (--out=DIR: where; default RUN_DIR/plots)",
                    frozenset({"--out"}), composes=False),
}
AUTO_LAYOUT = frozenset({"train", "submit"})
"""The commands on which parallel.auto=true chooses the layout (lctrain.prepare.auto)."""
EXIT_RUN_FAILED = 1
"""A run that started and failed (or a data error); the commands return it."""
EXIT_CONFIG = 2
"""A ConfigError: something on the command line (or in the files it names) must change."""
EXIT_RUN_DIR_LOCKED = 3
"""RunDirLocked: a live job holds the run dir; wait for it, stop it or pick another run dir."""


def usage() -> str:
    lines = ["usage: lctrain {" + ",".join(COMMANDS) + "} [+recipe=NAME] [key=value ...] [flags]",
             ""]
    for name, command in COMMANDS.items():
        flags = command.flags
        lines.append(f"  {name:<11} {command.summary}" + (f"  [{' '.join(sorted(flags))}]"
                                                           if flags else ""))
    lines += ["", "Every setting is a Hydra override, e.g. parallel.dp=2 train.steps=20 "
              "hydra.run.dir=runs/x. `lctrain keys [SECTION]` lists them; --cfg prints the "
              "resolved configuration of a command line without running it.",
              f"Recipes: {', '.join(recipe_names())}. Exit codes: 0 ok, {EXIT_RUN_FAILED} run "
              f"failure (or data error), {EXIT_CONFIG} configuration error, "
              f"{EXIT_RUN_DIR_LOCKED} run dir in use by a live job."]
    return "\n".join(lines)


def _run_command(name: str, words: list[str], flags: set[str]) -> int:
    command = COMMANDS[name]
    module = next((m for flag, m in command.routes.items() if flag in flags), command.module)
    composed = None
    if command.composes and not command.composes_itself & flags:
        composed = resolve_model(compose(words))
        if composed.cfg.parallel.auto and name in AUTO_LAYOUT:  # the search imports torch
            composed = importlib.import_module("lctrain.prepare.auto").apply_auto(name,
                                                                                  composed)
        if "--cfg" in flags:  # the resolved configuration, nothing run
            print(to_yaml(composed.cfg), end="")
            return 0
    # Imported only now (COMMANDS says why): importlib, so one line serves every command.
    return importlib.import_module(module).run(CommandArgs(words, frozenset(flags), composed))


def _parse(argv: list[str]) -> tuple[str, list[str], set[str]]:
    """(command, overrides, flags); raises ConfigError for an unknown command or flag."""
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(usage(), file=sys.stderr)
        raise ConfigError([f"unknown command {command!r}; use {', '.join(COMMANDS)}"])
    flags = {a for a in rest if a.startswith("--")}
    problems = [_flag_problem(command, f) for f in sorted(flags)]
    if any(problems):
        raise ConfigError([p for p in problems if p])
    return command, [a for a in rest if not a.startswith("--")], flags


VALUE_FLAGS = frozenset({"--out"})
"""Flags that take a value (--flag=VALUE); every other flag is a switch, given bare."""


def _flag_problem(command: str, flag: str) -> str | None:
    """What is wrong with `flag` on `lctrain command` (None: nothing): a flag the command does
    not take (naming the commands that do), or a value given to a switch."""
    name, has_value = flag.split("=", 1)[0], "=" in flag
    allowed = COMMANDS[command].flags | {"--help"}
    if name not in allowed:
        elsewhere = [c for c, spec in COMMANDS.items() if name in spec.flags]
        return (f"unknown flag {flag} for lctrain {command}; allowed: "
                f"{', '.join(sorted(allowed - {'--help'})) or 'none'}"
                + (f" ({name} belongs to {' and '.join(f'lctrain {c}' for c in elsewhere)})"
                   if elsewhere else ""))
    if has_value and name not in VALUE_FLAGS:
        return f"{flag}: {name} is a switch and takes no value; write {name} alone"
    return None


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if argv else EXIT_CONFIG)
    try:
        command, overrides, flags = _parse(argv)
        if "--help" in flags or "-h" in overrides:
            print(usage())
            sys.exit(0)
        sys.exit(_run_command(command, [o for o in overrides if o != "-h"], flags))
    except ConfigError as e:
        _report(e.header, e.problems)
        sys.exit(EXIT_CONFIG)
    except RunDirLocked as e:
        _report(e.header, e.problems)
        sys.exit(EXIT_RUN_DIR_LOCKED)


def _report(header: str, problems: list[str]) -> None:
    print(f"lctrain: {header}:", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)


if __name__ == "__main__":
    main()
