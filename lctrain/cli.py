"""`lctrain <command> [overrides...] [flags]`: parse the command line, compose the configuration,
run the command, and turn a ConfigError into its message and exit code 2 (the only place that
does).

Composition uses Hydra's compose API (not @hydra.main) so that every configuration error, including
Hydra's own (bad types, unknown groups), ends with exit code 2 and a readable message, and so
that nothing (run dir, process group, child process) exists before validation passes.
"""

from __future__ import annotations

import sys

from lctrain.commands.init_from import resolve_model
from lctrain.config import ConfigError
from lctrain.config.compose import compose
from lctrain.config.paths import recipe_names
from lctrain.config.resolved import to_yaml

COMMANDS = {  # name: (what it does, the flags it takes)
    "train": ("validate, then train (local ranks, torchrun or srun)", {"--cfg"}),
    "plan": ("validate and print the layout, per-rank shapes, memory and traffic (--calibrate: "
             "measure this machine's matmul rate and gloo bandwidth into plan.calibration)",
             {"--json", "--cfg", "--calibrate"}),
    "submit": ("render the sbatch script for slurm.* and submit it (--multirun: one job per "
               "combination of comma-separated values)", {"--dry-run", "--cfg", "--multirun"}),
    "preprocess": ("tokenize data.path with data.tokenizer into preprocess.output, for "
                   "data.source=tokens", {"--cfg"}),
    "keys": ("list every key (or those of the SECTIONs given) with its type, default, allowed "
             "values and meaning", set()),
    "status": ("RUN_DIR...: job state, last step, loss, tokens/s, ETA and newest checkpoint",
               set()),
    "plot": ("RUN_DIR...: PNGs of loss, tokens/s, MFU, memory and eval accuracy against step, "
             "runs overlaid (--out=DIR: where; default RUN_DIR/plots)", {"--out"}),
}
PATH_COMMANDS = {"keys", "status", "plot"}
"""Commands whose arguments are names or paths, not overrides: nothing is composed for them."""
EXIT_CONFIG = 2


def usage() -> str:
    lines = ["usage: lctrain {" + ",".join(COMMANDS) + "} [+recipe=NAME] [key=value ...] [flags]",
             ""]
    for name, (summary, flags) in COMMANDS.items():
        lines.append(f"  {name:<11} {summary}" + (f"  [{' '.join(sorted(flags))}]" if flags
                                                    else ""))
    lines += ["", "Every setting is a Hydra override, e.g. parallel.dp=2 train.steps=20 "
              "hydra.run.dir=runs/x. `lctrain keys [SECTION]` lists them; --cfg prints the "
              "resolved configuration of a command line without running it.",
              f"Recipes: {', '.join(recipe_names())}. Exit codes: 0 ok, 1 run failure (or data "
              "error), 2 configuration error."]
    return "\n".join(lines)


def _run_command(command: str, overrides: list[str], flags: set[str]) -> int:
    # Each command is imported when it runs: train and plan load torch (seconds), and
    # preprocess must start without it. keys, status and plot take names or paths.
    if command in PATH_COMMANDS:
        if command == "keys":
            from lctrain.commands import keys as module
        elif command == "status":
            from lctrain.commands import status as module
        else:
            from lctrain.commands import plot as module
        return module.run(overrides) if command == "keys" else module.run(overrides, flags)
    if command == "submit" and "--multirun" in flags:  # composes each combination itself
        from lctrain.commands import submit
        return submit.run_multirun(overrides, flags)
    composed = resolve_model(compose(overrides))
    if "--cfg" in flags:  # the resolved configuration, nothing run
        print(to_yaml(composed.cfg), end="")
        return 0
    if command == "plan" and "--calibrate" in flags:  # its own entry point: no plan printed
        from lctrain.commands import calibrate
        return calibrate.run(composed, flags)
    if command == "train":
        from lctrain.commands import train as module
    elif command == "plan":
        from lctrain.commands import plan as module
    elif command == "submit":
        from lctrain.commands import submit as module
    else:
        from lctrain.commands import preprocess as module
    return module.run(composed, flags)


def _parse(argv: list[str]) -> tuple[str, list[str], set[str]]:
    """(command, overrides, flags); raises ConfigError for an unknown command or flag."""
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(usage(), file=sys.stderr)
        raise ConfigError([f"unknown command {command!r}; use {', '.join(COMMANDS)}"])
    flags = {a for a in rest if a.startswith("--")}
    allowed = COMMANDS[command][1]
    unknown = sorted(f for f in flags if f.split("=", 1)[0] not in allowed | {"--help"})
    if unknown:
        raise ConfigError([f"unknown flag {f} for lctrain {command}; allowed: "
                           f"{', '.join(sorted(allowed)) or 'none'}" for f in unknown])
    return command, [a for a in rest if not a.startswith("--")], flags


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
        print(f"lctrain: {e.header}:", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


if __name__ == "__main__":
    main()
