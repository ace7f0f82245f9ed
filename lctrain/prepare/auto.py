"""parallel.auto=true on `lctrain train` and `lctrain submit`: the layout search
(`lctrain.planning.search`, what `lctrain plan plan.search=true` ranks) run for the world the
run will have, its winner printed with the runner-up and why it won, and applied as overrides
on top of the command line's, so the run is validated, recorded in config.yaml and submitted
like a hand-written layout (docs/parallelism.md §23).

The keys the search chooses that the command line sets are constraints: the search varies only
the others (`parallel.cp=8 parallel.auto=true` searches the layouts with cp = 8). Applied, the
winner's keys are on the command line too, so a rank started by torchrun or srun, or the job
`lctrain submit` renders, searching again finds that very layout.
"""

from __future__ import annotations

import sys

from lctrain.config import ConfigError
from lctrain.config.compose import Composed, compose
from lctrain.config.derived import local_world_size, slurm_world
from lctrain.parallel import launch
from lctrain.planning.hardware import Hardware, calibration_path, hardware_for, plan_hardware
from lctrain.planning.search import (
    SEARCHED_KEYS,
    Candidate,
    as_override,
    layout_label,
    search,
)
from lctrain.prepare.checks import uses_cuda, with_corpus
from lctrain.prepare.init_from import resolve_model


def override_key(override: str) -> str:
    """The dotted key an override sets (`+a.b=1` -> `a.b`)."""
    return override.split("=", 1)[0].lstrip("+~")


def fixed_keys(composed: Composed) -> dict[str, object]:
    """The searched keys the command line sets, with their composed values (parallel.dp=-1
    fixes nothing: it asks for the derived size)."""
    cfg, out = composed.cfg, {}
    for key in map(override_key, composed.overrides):
        if key in SEARCHED_KEYS:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            if key != "parallel.dp" or value != -1:
                out[key] = value
    return out


def apply_auto(command: str, composed: Composed) -> Composed:
    """`composed` with the layout parallel.auto chooses (as it is when parallel.auto=false):
    for `lctrain submit` the Slurm job's ranks on plan.* (or this CPU's calibration for CPU
    nodes, `plan_hardware`); for `lctrain train` the ranks torchrun or srun started, else
    launch.nproc, else those of the layout the recipe and the command line's other keys
    describe (`unconstrained`), on plan.* when the run uses CUDA and
    this CPU's calibration when it does not (plan.* and a note without one)."""
    cfg = composed.cfg
    if not cfg.parallel.auto:
        return composed
    if command == "submit":
        hw, notes = plan_hardware(cfg)
        return choose_layout(composed, slurm_world(cfg), hw, notes, talk=True)
    try:
        env = launch.env_from_environment()
    except RuntimeError as e:
        raise ConfigError([str(e)], header="invalid launch environment") from e
    gpu = uses_cuda(cfg)
    hw = hardware_for(cfg, gpu_available=gpu)
    notes = [] if gpu or hw.source != "plan.*" else [
        f"a CPU run without a calibration at {calibration_path(cfg)}: the search used plan.* "
        "(a GPU's numbers); run `lctrain plan --calibrate` first"]
    world = env.world_size if env else local_world_size(unconstrained(composed).cfg)
    return choose_layout(composed, world, hw, notes, talk=env is None or env.rank == 0)


def unconstrained(composed: Composed) -> Composed:
    """`composed` without the command line's searched keys: the layout the recipe describes,
    whose ranks a local run has (the constraints then do not change the world)."""
    return compose([o for o in composed.overrides if override_key(o) not in SEARCHED_KEYS])


def choose_layout(composed: Composed, world: int, hw: Hardware, notes: list[str],
                  talk: bool) -> Composed:
    """The search for `world` ranks under the command line's constraints; prints the winner
    and the runner-up (stderr, when `talk`) and returns the configuration composed with the
    winner's overrides added. No layout fits: a ConfigError naming the constraints."""
    fixed = fixed_keys(composed)
    result = search(with_corpus(composed.cfg), world, hw, fixed=fixed)
    constraints = " ".join(f"{k}={v}" for k, v in fixed.items()) or "none"
    if not result.ranked:
        raise ConfigError([
            f"parallel.auto=true: none of the {result.layouts:,} valid layouts of {world} "
            f"ranks fits plan.gpu_memory_gib={composed.cfg.plan.gpu_memory_gib:g} and "
            f"plan.host_memory_gib={composed.cfg.plan.host_memory_gib:g} (constraints from the "
            f"command line: {constraints}); drop a constraint, use more ranks, or a shorter "
            "train.seq_len"])
    winner = result.ranked[0]
    chosen = [f"{k}={as_override(v)}" for k, v in winner.overrides.items() if k not in fixed]
    for line in report(result.layouts, world, winner, best_alternative(result.ranked),
                       constraints, hw, notes) if talk else []:
        print(f"lctrain: {line}", file=sys.stderr)
    return resolve_model(compose([*composed.overrides, *chosen]))


ENGINE_KEYS = ("parallel.dp_engine", "deepspeed.zero_stage")
"""How the data-parallel state is kept, not where anything runs: a layout that differs from the
winner only in these is the winner again, not an alternative."""


def best_alternative(ranked: list[Candidate]) -> list[Candidate]:
    """The best candidate after the winner whose layout differs in more than the engine."""
    def layout(c: Candidate) -> dict:
        return {k: v for k, v in c.overrides.items() if k not in ENGINE_KEYS}

    return [c for c in ranked[1:] if layout(c) != layout(ranked[0])][:1]


def report(layouts: int, world: int, winner: Candidate, runner_up: list[Candidate],
           constraints: str, hw: Hardware, notes: list[str]) -> list[str]:
    """What parallel.auto chose and why, in a few lines."""
    lines = [f"parallel.auto: {layouts:,} valid layouts of {world} ranks searched "
             f"(constraints from the command line: {constraints}; hardware {hw.source})",
             f"chose     {layout_label(winner.overrides)}: {winner.step.total_s:.4g} s per "
             f"step predicted, {winner.memory_gib:.3f} GiB per rank",
             f"          {winner.command_line()}"]
    for c in runner_up:
        slower = c.step.total_s / winner.step.total_s - 1
        lines.append(f"runner-up {layout_label(c.overrides)}: {c.step.total_s:.4g} s per step "
                     f"({slower:+.1%}), {c.memory_gib:.3f} GiB per rank")
    if not runner_up:
        lines.append("runner-up: none (no other layout fits)")
    return lines + [f"note: {n}" for n in notes]
