"""`lctrain train | plan | submit | preprocess [overrides...]`: compose, validate, then act.

Composition uses Hydra's compose API (not @hydra.main) so that every configuration error, including
Hydra's own (bad types, unknown groups), ends with exit code 2 and a readable message, and so
that nothing (run dir, process group, child process) exists before validation passes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

USAGE = """usage: lctrain {{train,plan,submit,preprocess}} [+recipe=NAME] [key=value ...] [flags]

  train       validate, then train (local ranks, torchrun or srun)
  plan        validate and print the layout, per-rank shapes, memory and traffic  [--json]
  submit      render the sbatch script for slurm.* and submit it                  [--dry-run]
  preprocess  tokenize data.path with data.tokenizer into preprocess.output, for
              data.source=tokens (lctrain/data/preprocess.py)

Every setting is a Hydra override, e.g. parallel.dp=2 train.steps=20 hydra.run.dir=runs/x.
Recipes: {recipes}. Exit codes: 0 ok, 1 run failure (or data error), 2 configuration error.
"""

EXIT_CONFIG = 2


@dataclass
class Composed:
    cfg: object
    """LctrainConfig instance."""
    run_dir: Path
    overrides: list[str]


def fail_config(problems: list[str], header: str = "invalid configuration") -> None:
    """Print every problem and exit 2."""
    print(f"lctrain: {header}:", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from lctrain.paths import recipe_names

    usage = USAGE.format(recipes=", ".join(recipe_names()))
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage)
        sys.exit(0 if argv else EXIT_CONFIG)
    command, rest = argv[0], argv[1:]
    if command not in ("train", "plan", "submit", "preprocess"):
        print(usage, file=sys.stderr)
        fail_config([f"unknown command {command!r}; use train, plan, submit or preprocess"])
    flags = {a for a in rest if a.startswith("--")}
    allowed = {"train": set(), "plan": {"--json"}, "submit": {"--dry-run"},
               "preprocess": set()}[command]
    if "--help" in flags or "-h" in rest:
        print(usage)
        sys.exit(0)
    if flags - allowed:
        fail_config([f"unknown flag {f} for lctrain {command}; allowed: "
                     f"{', '.join(sorted(allowed)) or 'none'}" for f in sorted(flags - allowed)])
    overrides = [a for a in rest if not a.startswith("--")]
    from lctrain.compose import compose

    composed = compose(overrides)
    if command == "train":
        from lctrain.run import run_train

        sys.exit(run_train(composed))
    if command == "plan":
        from lctrain.plan import run_plan

        sys.exit(run_plan(composed, as_json="--json" in flags))
    if command == "preprocess":
        from lctrain.data.preprocess import run_preprocess

        sys.exit(run_preprocess(composed))
    from lctrain.slurm import run_submit

    sys.exit(run_submit(composed, dry_run="--dry-run" in flags))


if __name__ == "__main__":
    main()
