"""`lctrain submit`: check a job against the layout and the cluster, render its sbatch script
(templates/submit.sbatch), save it with the resolved config in the run dir, and submit it;
`--multirun` submits one job per combination of comma-separated values after checking every
combination.

The batch script starts one srun task per node, each a torchrun (`python -m
torch.distributed.run` of the submitter's own Python, or slurm.python) over the node's ranks:
its GPUs, or on a CPU partition (slurm.gpus_per_node=0) launch.nproc / slurm.nodes gloo ranks.
The rendezvous address and port come from `lctrain.commands.job` on the first node.

Preemption and requeue: Slurm sends USR1 to the batch shell slurm.signal_before_s before the time
limit; its trap writes the job's token (job id and restart count) into RUN_DIR/STOP, and lctrain
checkpoints after the current step, records the token in RUN_DIR/STOPPED and exits 0
(`lctrain.training.preemption`). Only then (STOPPED holds this start's token) does the script
requeue the job (slurm.requeue); a USR1 after the last step requeues nothing. The requeued
job, like a resubmitted one with the same hydra.run.dir, resumes from the newest checkpoint
(the job runs with checkpoint.resume=auto) and discards the old STOP file, whose token is not
its own. Slurm's own requeue (node failure, preemption) resumes the same way.

Sweeps use a loop of our own over Hydra's override grammar rather than Hydra's submitit launcher:
the launcher pickles a Python function into its own sbatch template (one task per rank, no
torchrun, no USR1 trap or requeue), needs `@hydra.main` where lctrain composes with the compose
API so that every error exits 2 before anything starts, and would submit the combinations it can
before failing on a bad one. Here every combination is composed and checked first, then each is
submitted as the same batch script a single `lctrain submit` renders.
"""

from __future__ import annotations

import itertools
import re
import shlex
import shutil
import string
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from lctrain.commands import CommandArgs
from lctrain.config import ConfigError, LctrainConfig
from lctrain.config.compose import Composed, compose
from lctrain.config.derived import local_world_size, slurm_ranks_per_node, slurm_world
from lctrain.config.resolved import to_yaml
from lctrain.prepare.checks import preflight
from lctrain.prepare.init_from import resolve_model, typed_keys
from lctrain.rundir import RunDir
from lctrain.rundir.files import write_atomic
from lctrain.training.preemption import STOPPED

STOP_TOKEN = "${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"
"""What the USR1 trap writes into RUN_DIR/STOP: this job, this start of it."""
TEMPLATES = Path(__file__).with_name("templates")
"""The batch script's template files (package data: pyproject.toml ships them)."""
"""Job ids submitted into a run dir, one per line, oldest first (`lctrain status` reads it)."""


def job_python(cfg: LctrainConfig) -> str:
    return cfg.slurm.python or sys.executable


def cpus_per_task(cfg: LctrainConfig) -> int:
    s = cfg.slurm
    if s.cpus_per_task is not None:
        return s.cpus_per_task
    if s.gpus_per_node > 0:
        return s.gpus_per_node * s.cpus_per_gpu
    return max(slurm_ranks_per_node(cfg), 1)


def job_overrides(cfg: LctrainConfig, overrides: list[str], run_dir: Path) -> list[str]:
    """The overrides the job's `lctrain train` runs with: the user's, the run dir made absolute,
    and checkpoint.resume=auto so that a requeued or resubmitted job resumes."""
    keep = [o for o in overrides if not o.lstrip("+~").startswith("hydra.run.dir=")]
    if "resume" not in typed_keys(overrides, "checkpoint") and cfg.checkpoint.load is None:
        keep.append("checkpoint.resume=auto")
    return [*keep, run_dir_override(run_dir.resolve())]


def run_dir_override(path: Path) -> str:
    """hydra.run.dir=PATH, quoted for Hydra's grammar (a sweep's run dirs contain = and ,)."""
    quoted = str(path).replace("'", "\\'")
    return f"hydra.run.dir='{quoted}'"


class ScriptTemplate(string.Template):
    """A template whose placeholders are `{{name}}`, so that the shell's own `$VAR`, `${VAR:-0}`
    and `$(...)` stay verbatim in the template file."""

    pattern = r"""\{\{(?:
        (?P<named>[a-z_][a-z0-9_]*)\}\}   # {{name}}
        | (?P<escaped>(?!))              # no escape: a batch script has no other {{
        | (?P<braced>(?!))
        | (?P<invalid>)                  # any other {{ is a mistake in the template
    )"""


_BLOCK_LINE = re.compile(r"^(\{\{[a-z_][a-z0-9_]*\}\})\n", re.MULTILINE)
"""A line that holds only a placeholder: it stands for zero or more whole lines."""


def render_template(name: str, **values: object) -> str:
    """The template file `name` of lctrain/commands/templates/, filled (see `fill`)."""
    return fill((TEMPLATES / name).read_text(), values)


def fill(template: str, values: Mapping[str, object]) -> str:
    """`template` with each {{key}} replaced by values[key]. A line that holds only {{key}}
    takes a list of lines: its lines, none when the list is empty. Values are inserted as they
    are (never read as placeholders)."""
    values = dict(values)
    for key in {m.group(1)[2:-2] for m in _BLOCK_LINE.finditer(template)}:
        assert isinstance(values[key], list), f"{{{{{key}}}}} stands for lines: give a list"
        values[key] = "".join(f"{line}\n" for line in values[key])
    return ScriptTemplate(_BLOCK_LINE.sub(r"\1", template)).substitute(values)


def render_sbatch(cfg: LctrainConfig, overrides: list[str], run_dir: Path) -> str:
    """The batch script for `cfg` (see the module docstring), from templates/submit.sbatch."""
    s = cfg.slurm
    run_dir = run_dir.resolve()
    per_node, cpus = slurm_ranks_per_node(cfg), cpus_per_task(cfg)
    requeue = render_template("submit_requeue.sbatch", stop_token=STOP_TOKEN,
                              stopped_file=shlex.quote(str(run_dir / STOPPED)))
    return render_template(
        "submit.sbatch", job_name=s.job_name, nodes=s.nodes,
        gpu_request=[f"#SBATCH --gpus-per-node={s.gpus_per_node}"] if s.gpus_per_node else [],
        cpus_per_task=cpus, time=s.time, run_dir=run_dir, signal_before_s=s.signal_before_s,
        requeue_flag="--requeue" if s.requeue else "--no-requeue",
        placement=[f"#SBATCH --{flag}={value}" for flag, value in
                   (("partition", s.partition), ("account", s.account), ("qos", s.qos)) if value],
        stop_token=STOP_TOKEN, stop_file=shlex.quote(str(RunDir(run_dir).stop)),
        setup=list(s.setup), exports=[f"export {k}={shlex.quote(str(v))}"
                                      for k, v in s.env.items()],
        omp_num_threads=max(cpus // max(per_node, 1), 1), python=shlex.quote(job_python(cfg)),
        ranks_per_node=per_node,
        overrides=" ".join(shlex.quote(o) for o in job_overrides(cfg, overrides, run_dir)),
        requeue=requeue.splitlines() if s.requeue else [])


def slurm_problems(cfg: LctrainConfig, overrides: list[str]) -> list[str]:
    """What makes slurm.* unable to run this layout, before any cluster is asked."""
    s, problems = cfg.slurm, []
    if s.gpus_per_node == 0 and slurm_ranks_per_node(cfg) == 0:
        total = local_world_size(cfg)
        problems.append(f"{total} ranks (launch.nproc, default tp*cp*pp*dp) cannot be split "
                        f"evenly over slurm.nodes={s.nodes} CPU nodes; set launch.nproc to a "
                        f"multiple of {s.nodes} or change slurm.nodes")
    if s.python is not None and not Path(s.python).is_absolute():
        problems.append(f"slurm.python={s.python} must be an absolute path (the batch shell's "
                        "PATH is not the submitter's)")
    if s.requeue and cfg.checkpoint.load is not None:
        problems.append("slurm.requeue=true with checkpoint.load: a requeued job would start "
                        "again from checkpoint.load; start from weights with model.init_from, "
                        "or set slurm.requeue=false")
    if s.requeue and "resume" in typed_keys(overrides, "checkpoint") and \
            cfg.checkpoint.resume != "auto":
        problems.append("slurm.requeue=true with checkpoint.resume=none: a requeued job would "
                        "start over; drop the override (submit runs with resume=auto) or set "
                        "slurm.requeue=false")
    return problems


@dataclass
class Partition:
    name: str
    nodes: int
    cpus: int
    gpus: int
    """GPUs per node its GRES offers (0: none)."""
    default: bool


def partitions() -> dict[str, Partition]:
    """The cluster's partitions as sinfo reports them (one row per partition)."""
    out = subprocess.run(["sinfo", "-h", "-o", "%P|%D|%c|%G"], capture_output=True, text=True,
                         check=True).stdout
    found = {}
    for line in out.splitlines():
        name, nodes, cpus, gres = line.split("|")
        gpus = max((int(m.group(1)) for m in re.finditer(r"gpu(?::[\w.-]+)?:(\d+)", gres)),
                   default=0)
        part = Partition(name.rstrip("*"), int(nodes), int(re.match(r"\d+", cpus).group()), gpus,
                         name.endswith("*"))
        found[part.name] = part
    return found


def cluster_problems(cfg: LctrainConfig, parts: dict[str, Partition]) -> list[str]:
    """What keeps this job from ever starting on the cluster sinfo describes."""
    s = cfg.slurm
    name = s.partition or next((p.name for p in parts.values() if p.default), None)
    if name not in parts:
        return [f"slurm.partition={s.partition} does not exist on this cluster; partitions: "
                f"{', '.join(parts) or 'none'}" if s.partition else
                "the cluster has no default partition; set slurm.partition"]
    part, problems = parts[name], []
    if s.gpus_per_node > part.gpus:
        problems.append(f"slurm.gpus_per_node={s.gpus_per_node} but partition {name} offers "
                        f"{part.gpus} GPUs per node, so the job would never start; "
                        + ("set slurm.gpus_per_node=0 to run on its CPUs" if part.gpus == 0 else
                           f"set slurm.gpus_per_node<={part.gpus}"))
    if s.nodes > part.nodes:
        problems.append(f"slurm.nodes={s.nodes} but partition {name} has {part.nodes} node(s)")
    if cpus_per_task(cfg) > part.cpus:
        problems.append(f"--cpus-per-task={cpus_per_task(cfg)} exceeds the {part.cpus} CPUs of "
                        f"a node in partition {name}; set slurm.cpus_per_task (or "
                        "slurm.cpus_per_gpu) lower")
    return problems


def job_problems(composed: Composed) -> list[str]:
    """Everything wrong with one job before the cluster is asked."""
    cfg = composed.cfg
    problems = slurm_problems(cfg, composed.overrides)
    return problems or preflight(cfg, slurm_world(cfg))


def expand_sweep(overrides: list[str]) -> list[tuple[list[str], str]]:
    """Every combination of the sweep overrides (`key=a,b`, `key=range(...)`, Hydra's grammar):
    (overrides, label naming the swept values), in order, the last key varying fastest."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError([str(e)], header="the sweep could not be parsed") from e
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([(f"{key}={v}", f"{key}={v}") for v in o.sweep_string_iterator()])
        else:
            choices.append([(o.input_line, "")])
    out = []
    for combo in itertools.product(*choices):
        label = ",".join(lab for _, lab in combo if lab)
        out.append(([line for line, _ in combo], label))
    return out


def _sweep(overrides: list[str]) -> list[Composed]:
    """One Composed per combination, each in its own run dir under the first one's
    (`<run dir>/<i>_<swept values>`)."""
    combos = expand_sweep(overrides)
    try:
        base = compose(combos[0][0]).run_dir
    except ConfigError as e:
        raise ConfigError(e.problems, header="the sweep's first job could not be composed") from e
    composed, problems = [], []
    for i, (combo, label) in enumerate(combos):
        name = f"{i}_{re.sub(r'[^A-Za-z0-9._=,+-]', '_', label)}" if label else str(i)
        try:
            job = resolve_model(compose([*combo, run_dir_override(base / name)]))
            if job.cfg.parallel.auto:
                # here only: the search imports torch, which submitting otherwise never does
                from lctrain.prepare.auto import apply_auto

                job = apply_auto("submit", job)
        except ConfigError as e:
            problems += [f"[{label}] {p}" for p in e.problems]
            continue
        composed.append(job)
        problems += [f"[{label}] {p}" for p in job_problems(job)]
    if problems:
        raise ConfigError(problems, header=f"none of the sweep's {len(combos)} jobs was "
                                           "submitted")
    return composed


def _sbatch() -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError(["sbatch is not on PATH: run lctrain submit on a Slurm login node (or "
                           "start a local Slurm: python tools/local_slurm.py start DIR), or use "
                           "--dry-run to print the batch script"],
                          header="no Slurm here")
    return sbatch


def submit(composed: Composed, sbatch: str) -> str:
    """Save the script and config in the run dir, submit, and return the job id."""
    run_dir = composed.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    room = RunDir(run_dir)
    script = run_dir / "submit.sbatch"
    script.write_text(render_sbatch(composed.cfg, composed.overrides, run_dir))
    write_atomic(room.config, to_yaml(composed.cfg))  # whole or not at all
    done = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch {script} failed: {done.stderr.strip()}")
    job_id = done.stdout.strip().split(";")[0]
    with open(room.jobs, "a") as f:
        f.write(job_id + "\n")
    return job_id


def _submit_all(jobs: list[Composed], flags: frozenset[str]) -> int:
    if "--dry-run" in flags:
        for composed in jobs:
            if len(jobs) > 1:
                print(f"# run dir {composed.run_dir.resolve()}")
            print(render_sbatch(composed.cfg, composed.overrides, composed.run_dir), end="")
        return 0
    sbatch = _sbatch()
    problems = []
    if shutil.which("sinfo"):
        parts = partitions()
        problems = [p for c in jobs for p in cluster_problems(c.cfg, parts)]
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)), header="the cluster cannot run this job")
    for note in jobs[0].notes:
        print(f"lctrain: {note}", file=sys.stderr)
    for composed in jobs:
        try:
            job_id = submit(composed, sbatch)
        except RuntimeError as e:
            print(f"lctrain: {e}", file=sys.stderr)
            return 1
        run_dir = composed.run_dir.resolve()
        print(f"lctrain: submitted job {job_id}; run dir {run_dir}; follow it with `lctrain "
              f"status {run_dir}`")
    return 0


def run(args: CommandArgs) -> int:
    if "--multirun" in args.flags:
        return run_multirun(args.words, args.flags)
    problems = job_problems(args.composed)
    if problems:
        raise ConfigError(problems)
    return _submit_all([args.composed], args.flags)


def run_multirun(overrides: list[str], flags: frozenset[str]) -> int:
    """One job per combination of the sweep: all composed and checked, then all submitted
    (--dry-run: printed; --cfg: their configurations printed)."""
    jobs = _sweep(overrides)
    if "--cfg" in flags:
        for composed in jobs:
            print(f"# run dir {composed.run_dir.resolve()}\n{to_yaml(composed.cfg)}", end="")
        return 0
    return _submit_all(jobs, flags)
