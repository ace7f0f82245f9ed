"""`lctrain train`: resolve the world size, check everything, then run the ranks.

Started under torchrun or srun, this process is one rank. Started plainly with a layout of more
than one rank, it starts `launch.nproc` local ranks itself and exits non-zero, naming the rank,
as soon as any of them fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from lctrain.commands.checks import preflight
from lctrain.config import ConfigError, LctrainConfig
from lctrain.config.compose import Composed
from lctrain.config.validation import check_supported, warnings_for
from lctrain.parallel import launch
from lctrain.planning.memory import param_count
from lctrain.training import loop


def local_world_size(cfg: LctrainConfig) -> int:
    """launch.nproc, else tp*cp*pp*dp with dp=-1 counting as 1."""
    if cfg.launch.nproc is not None:
        return cfg.launch.nproc
    p = cfg.parallel
    return p.tp * p.cp * p.pp * max(p.dp, 1)


def host_problems(cfg: LctrainConfig, nproc: int) -> list[str]:
    """Can this machine host `nproc` local ranks? (devices, rough memory)"""
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto"
                                              and torch.cuda.is_available())
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        return ["train.device=cuda but torch sees no CUDA device; use train.device=cpu"]
    if use_cuda and nproc > torch.cuda.device_count():
        return [f"launch.nproc={nproc} local ranks need {nproc} GPUs, this machine has "
                f"{torch.cuda.device_count()}; lower the parallel sizes or launch with "
                "torchrun/srun across nodes"]
    if use_cuda:
        return []
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


def _rank_main(cfg: LctrainConfig, run_dir: str) -> None:
    loop.train(cfg, run_dir)


def run(composed: Composed, flags: set[str]) -> int:
    cfg = composed.cfg
    try:
        env = launch.env_from_environment()
    except RuntimeError as e:
        raise ConfigError([str(e)], header="invalid launch environment") from e
    world = env.world_size if env else local_world_size(cfg)
    problems = preflight(cfg, world) + check_supported(cfg)
    if not problems and env is None:
        problems += host_problems(cfg, world)
    if problems:
        raise ConfigError(problems)
    rank = env.rank if env else 0
    if rank == 0:
        for w in warnings_for(cfg):
            print(f"lctrain: warning: {w}", file=sys.stderr)
    run_dir = composed.run_dir
    if env is not None or world == 1:
        _rank_main(cfg, str(run_dir))
        return 0
    threads = max(1, (os.cpu_count() or 1) // world)
    try:
        launch.run_ranks(_rank_main, world, (cfg, str(run_dir)),
                         start_method=cfg.launch.start_method, threads=threads, backend=None,
                         master_port=cfg.launch.master_port,
                         collective_timeout_s=cfg.launch.timeout_s)
    except launch.RankFailure as e:
        print(f"lctrain: {e}; all ranks were stopped (its traceback, if any, is above)",
              file=sys.stderr)
        return 1
    print(f"lctrain: done; run dir {Path(run_dir).resolve()}")
    return 0
