"""`lctrain train`: resolve the world size, check everything, then run the ranks
(`run_on_ranks`, which `lctrain eval` runs with its own work on each rank).

Started under torchrun or srun, this process is one rank. Started plainly with a layout of more
than one rank, it starts `launch.nproc` local ranks itself and exits non-zero, naming the rank,
as soon as any of them fails. Before any rank starts, the launching process (under torchrun or
srun: global rank 0) takes the run dir's lock, so that a second job in the same run dir exits 3
naming the first (`lctrain.rundir.lock`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from lctrain.attention.delta_rule import DELTA_RULES
from lctrain.attention.kernels import KERNEL_CODE
from lctrain.commands import CommandArgs
from lctrain.config import ConfigError, LctrainConfig
from lctrain.config.derived import local_world_size
from lctrain.config.device_rules import cuda_problems, kernel_device_problems
from lctrain.config.kernel_backends import LINEAR_KERNELS, backends_on, kernel_backend
from lctrain.config.model_size import param_count
from lctrain.config.validation import warnings_for
from lctrain.data.ingest import DataError
from lctrain.parallel import launch
from lctrain.prepare.checks import preflight, uses_cuda
from lctrain.rundir import RunDir, rank_records
from lctrain.rundir import lock as run_lock
from lctrain.rundir.files import RunDirError, write_atomic
from lctrain.training import loop
from lctrain.training.checkpoint import CheckpointError
from lctrain.training.loop import NonFiniteError

RUN_ERRORS = (RunDirError, CheckpointError, DataError, NonFiniteError)
"""Run failures whose message names the file, step or data and what to do."""


def cuda_host_problems(cfg: LctrainConfig, nproc: int | None) -> list[str]:
    """What this machine needs for a CUDA run: GPUs for the local ranks, and flash-attn when
    train.attention_kernel names it (auto falls back to torch's built-in kernels)."""
    gpus = launch.cuda_devices()
    if gpus == 0:
        return ["train.device=cuda but torch sees no CUDA device; use train.device=cpu"]
    problems = [] if cfg.train.device == "cuda" else cuda_problems(cfg)  # auto resolved here
    if nproc is not None and nproc > gpus:
        problems.append(f"launch.nproc={nproc} local ranks need {nproc} GPUs, this machine has "
                        f"{gpus}; lower the parallel sizes or launch with torchrun/srun across "
                        "nodes")
    problems += kernel_install_problems(cfg.train.attention_kernel)
    linear = cfg.train.linear_kernel
    if linear != "auto" and not DELTA_RULES[linear].installed():
        facts = LINEAR_KERNELS[linear]
        problems.append(f"train.linear_kernel={linear}, and {facts.package} is not installed: "
                        f"{facts.install}; or train.linear_kernel=torch (no extra package)")
    return problems


def kernel_install_problems(name: str) -> list[str]:
    """A named attention kernel whose package does not import here: what to install, or the
    backend of the same device that needs no package."""
    if name == "auto" or KERNEL_CODE[name].installed():
        return []
    facts = kernel_backend(name)
    plain = [n for n in backends_on(facts.device) if kernel_backend(n).package is None]
    return [f"train.attention_kernel={name}, and {facts.package} is not installed: "
            f"{facts.install}" + (f"; or train.attention_kernel={plain[0]} (no extra package)"
                                   if plain else "")]


def host_problems(cfg: LctrainConfig, nproc: int) -> list[str]:
    """Can this machine host `nproc` local ranks? (devices, flash-attn, rough memory)"""
    if uses_cuda(cfg):
        return cuda_host_problems(cfg, nproc)
    if cfg.train.device == "auto":  # resolved to the CPU here
        problems = kernel_device_problems(cfg, "cpu")
        if problems:
            return problems
    # Every rank builds the full fp32 model; FSDP then keeps a 1/nproc shard of weights,
    # gradients and two AdamW moments (4 + 12 / nproc bytes per parameter), DDP all 16 bytes.
    per_param = 16 if cfg.parallel.dp_engine == "ddp" else 4 + 12 / nproc
    need = nproc * param_count(cfg.model) * per_param
    avail = _available_memory()
    if avail is not None and need > avail:
        return [f"{nproc} CPU ranks of model.name={cfg.model.name} need about {need / 2**30:.1f} "
                f"GiB for weights and optimizer state; {avail / 2**30:.1f} GiB is available; "
                "use a smaller model (model=tiny) or fewer ranks"]
    return []


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


RankWork = Callable[[LctrainConfig, str], object]
"""What a rank runs: loop.train, or lctrain eval's scoring.evaluate."""


def _rank_main(cfg: LctrainConfig, run_dir: str, work: RankWork = loop.train) -> None:
    """One rank: `work` (train), then leave the process group (torchrun and local ranks
    alike)."""
    try:
        work(cfg, run_dir)
    except Exception as e:
        if os.environ.get("LCTRAIN_LAUNCHER") != "local" and launch.env_from_environment():
            # under torchrun/srun each rank reports (the local launcher reports for its ranks)
            _report_stall(Path(run_dir), f"this rank failed: {type(e).__name__}: {e}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report_stall(run_dir: Path, why: str, always: bool = False) -> list[int]:
    """Print and save the stall report when some rank is behind (or `always`); returns those
    ranks."""
    records = rank_records.read_records(run_dir)
    behind, _ = rank_records.diagnose(records)
    if behind or always:
        report = rank_records.stall_report(records, why)
        path = rank_records.write_report(run_dir, report)
        print(f"{report}\n(saved to {path})", file=sys.stderr, flush=True)
    return behind


def _stall_watchdog(run_dir: Path, stall_s: int):
    """For the local launcher: (rank, reason) once no rank has advanced for stall_s."""
    def check() -> tuple[int, str] | None:
        idle = rank_records.stalled_for(rank_records.read_records(run_dir))
        if not stall_s or idle <= stall_s:
            return None
        behind = _report_stall(run_dir, f"no rank advanced for {idle:.0f} s; "
                                        f"launch.stall_s={stall_s}", always=True)
        return (behind[0] if behind else 0,
                f"made no progress for {idle:.0f} s (launch.stall_s={stall_s}; report above)")
    return check


def run(args: CommandArgs) -> int:
    return run_on_ranks(args, loop.train, recorded=True)


def run_on_ranks(args: CommandArgs, work: RankWork,
                 checks: Callable[[LctrainConfig], list[str]] = lambda _cfg: [],
                 recorded: bool = False) -> int:
    """`work` on every rank of the world the config asks for, after every check (the
    command's own `checks` included): `lctrain train`, and `lctrain eval`. `recorded`: the
    command's words are kept in the run dir (command.json), which the command that resumes
    the run is made from."""
    composed = args.composed
    cfg = composed.cfg
    try:
        env = launch.env_from_environment()
    except RuntimeError as e:
        raise ConfigError([str(e)], header="invalid launch environment") from e
    world = env.world_size if env else local_world_size(cfg)
    problems = checks(cfg) + preflight(cfg, world)
    if not problems and env is None:
        problems += host_problems(cfg, world)
    elif not problems and uses_cuda(cfg):  # under torchrun or srun: this rank's machine
        problems += cuda_host_problems(cfg, None)
    if problems:
        raise ConfigError(problems)
    rank = env.rank if env else 0
    if rank == 0:
        for note in composed.notes:
            print(f"lctrain: {note}", file=sys.stderr)
        for w in warnings_for(cfg):
            print(f"lctrain: warning: {w}", file=sys.stderr)
    run_dir = composed.run_dir
    with _lock_run_dir(run_dir, rank):
        if recorded and rank == 0:
            write_atomic(RunDir(run_dir).command, json.dumps(args.words))
        return _start(cfg, env is not None, world, run_dir, work)


def _lock_run_dir(run_dir: Path, rank: int) -> contextlib.AbstractContextManager:
    """The run dir's lock (lctrain.rundir.lock), taken before any rank or process group
    exists by this process when it launches the ranks, by global rank 0 under torchrun or srun
    (if it refuses, torchrun stops the others); held until the ranks have ended."""
    if rank != 0:
        return contextlib.nullcontext()
    lock = run_lock.acquire(run_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
    if lock.took_over:
        print(f"lctrain: took over the run dir lock of {lock.took_over}", file=sys.stderr)
    return lock


def _start(cfg: LctrainConfig, under_launcher: bool, world: int, run_dir: Path,
           work: RankWork) -> int:
    """Run `work` in this process (a rank of torchrun/srun, or a world of one), or launch the
    local ranks and wait for them."""
    if under_launcher or world == 1:
        if under_launcher:
            launch.die_with_parent()  # torchrun's agent (or srun's step daemon)
        try:
            _rank_main(cfg, str(run_dir), work)
        except RUN_ERRORS as e:  # their message says it all: no traceback
            print(f"lctrain: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        return 0
    threads = max(1, (os.cpu_count() or 1) // world)
    start_method = cfg.launch.start_method
    if start_method == "auto":
        start_method = "spawn" if uses_cuda(cfg) else "fork"
    try:
        launch.run_ranks(_rank_main, world, (cfg, str(run_dir), work), start_method=start_method,
                         threads=threads, backend=None,
                         master_port=cfg.launch.master_port,
                         collective_timeout_s=cfg.launch.timeout_s,
                         watchdog=_stall_watchdog(Path(run_dir), cfg.launch.stall_s))
    except launch.RankFailure as e:
        behind = (rank_records.diagnose(rank_records.read_records(Path(run_dir)))[0]
                  if "launch.stall_s" in e.reason else _report_stall(Path(run_dir), str(e)))
        blame = (f"rank(s) {', '.join(map(str, behind))} fell behind (stall report above); "
                 if behind else "")
        print(f"lctrain: {blame}{e}; all ranks were stopped (its traceback, if any, is above)",
              file=sys.stderr)
        return 1
    early = rank_records.stopped(rank_records.read_records(Path(run_dir)))
    print(f"lctrain: {'done' if early is None else 'stopped after step ' + str(early['step'])}; "
          f"run dir {Path(run_dir).resolve()}")
    return 0
