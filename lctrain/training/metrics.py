"""What a run logs and where: `StepMeter` measures, on every rank, what a step cost (model FLOPs
utilisation, peak memory, the loader's wait, traffic per group); `MetricsLogger` writes each
logged step on rank 0 to the console (progress bar or plain lines), metrics.jsonl in the run
dir, and optionally W&B and TensorBoard.

Keys a logged step gets besides the loss and timings (docs/parallelism.md §14):
- `tflops_per_rank`: model FLOPs of the step (`lctrain.planning.flops`, activation recomputation
  not counted) / (step_time x world size), in TFLOP/s; `mfu` the same over the peak of one rank:
  logging.peak_tflops, else a known GPU's datasheet peak (dense, in the run's dtype), else on the
  CPU this machine's fp32 matmul rate measured once at the start (CPU MFU is against the
  measured matmul rate; no datasheet peak exists); null for a GPU not in the table.
- `peak_mem_bytes`: the most any rank held since the previous logged step (that step's evals and
  checkpoints included): CUDA's max_memory_allocated, on the CPU the process's resident-set high
  water mark (VmHWM, reset through /proc/self/clear_refs; where that is not permitted, the
  lifetime peak, and the run says so once at the start).
- `data_time`: the wait for the loader, the largest over the ranks at logged steps.
- `traffic/{cp,ep,tp,pp,dp}`: bytes one rank sent in the step, for groups of more than one
  rank. `traffic/ep` is measured (the experts' all-to-all, docs/parallelism.md §28);
  `traffic/cp` is measured (`record_traffic` counts lctrain's own collectives, the
  context-parallel attention; also kept as `cp_bytes_sent`); `traffic/tp`, `traffic/pp` and
  `traffic/dp` (FSDP/DDP over dp x cp) are the formulas of `lctrain.planning.traffic` for
  collectives torch issues (DTensor, the pipeline schedule, FSDP/DDP), the largest over the
  pipeline ranks.
"""

from __future__ import annotations

import errno
import json
import math
import os
import resource
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from lctrain import device
from lctrain.config import LctrainConfig, LoggingConfig
from lctrain.parallel.runtime import Runtime
from lctrain.planning.flops import datasheet_peak_tflops, mfu, train_flops_per_step
from lctrain.planning.traffic import step_traffic_bytes
from lctrain.rundir import RunDir
from lctrain.rundir.files import RunDirError, describe_os_error, write_advice, write_atomic

WANDB_ID_FILE = "wandb_run_id"
"""The W&B run id in the run dir: a restarted run continues that W&B run."""


def measure_matmul_tflops(n: int = 512, repeats: int = 4) -> float:
    """This CPU's fp32 matmul rate, TFLOP/s, with the threads torch uses in this process: the
    fastest of `repeats` timed [n, n] @ [n, n] products after one warm-up (a few ms each)."""
    a, b = torch.ones(n, n), torch.full((n, n), 0.5)  # no random draw: the RNG stays untouched
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def cuda_precision(dtype: str) -> str:
    """The matmul precision of a CUDA run in train.dtype `dtype`: bf16, or for fp32 tf32 when
    torch lets fp32 matmuls use TF32 tensor cores, else fp32."""
    if dtype == "bf16":
        return "bf16"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def peak_tflops_per_rank(cfg: LctrainConfig, rt: Runtime) -> tuple[float | None, str]:
    """(peak TFLOP/s of one rank or None, where it comes from). On the CPU every rank measures
    at once (contending for the cores as the run does) and the ranks' mean is taken: collective
    on the CPU without logging.peak_tflops."""
    if cfg.logging.peak_tflops is not None:
        return cfg.logging.peak_tflops, "logging.peak_tflops"
    if device.gpu_path(rt.device):
        name, precision = device.name(rt.device), cuda_precision(cfg.train.dtype)
        peak = datasheet_peak_tflops(name, precision)
        if peak is None:
            return None, (f"no datasheet peak for GPU {name!r}: mfu is null; set "
                          f"logging.peak_tflops=<dense {precision} TFLOP/s of one GPU>")
        return peak, f"the {precision} datasheet peak of {name}, dense"
    if rt.world_size > 1:
        dist.barrier()
    rate = torch.tensor([measure_matmul_tflops()], dtype=torch.float64)
    if rt.world_size > 1:
        dist.all_reduce(rate)
        rate /= rt.world_size
    return float(rate), ("the fp32 matmul rate measured on this CPU; no datasheet peak exists "
                         "for CPUs")


class PeakMemory:
    """This process's peak memory since `reset`: on CUDA the allocator's max_memory_allocated;
    on the CPU the resident-set high water mark (VmHWM of /proc/self/status), reset by writing
    5 to /proc/self/clear_refs. Where that is refused (or /proc is missing), `per_step` turns
    False and the value is the process's lifetime peak."""

    def __init__(self, device: torch.device):
        self.device, self.per_step = device, True

    def reset(self) -> None:
        if device.gpu_path(self.device):
            device.reset_peak(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.per_step = False

    def read(self) -> int:
        if device.gpu_path(self.device):
            return device.peak_allocated(self.device)
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
        except OSError:
            pass
        self.per_step = False
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB (bytes on macOS)
        return peak if sys.platform == "darwin" else peak * 1024


class StepMeter:
    """Per-step costs, on every rank: `per_step` (local arithmetic) after each step, `reduce`
    (one all_reduce over the world) at logged steps only, which every rank takes at the same
    steps (`MetricsLogger.should_log` is deterministic)."""

    def __init__(self, cfg: LctrainConfig, rt: Runtime, info: Callable[[str], None]):
        self.rt, self.info = rt, info
        self.flops_per_step = train_flops_per_step(cfg, rt.derived.tokens_per_step)
        self.peak_tflops, source = peak_tflops_per_rank(cfg, rt)
        self.traffic = {f"traffic/{group}": nbytes
                        for group, nbytes in step_traffic_bytes(cfg, rt.world_size).items()}
        self.measure_cp = cfg.parallel.cp > 1
        self.measure_ep = cfg.parallel.ep > 1
        self.memory = PeakMemory(rt.device)
        peak = "unknown" if self.peak_tflops is None else f"{self.peak_tflops:.4g} TFLOP/s"
        info(f"lctrain: {self.flops_per_step:.3e} model FLOPs per step; MFU against {peak} per "
             f"rank: {source}")

    def start(self) -> None:
        """Before the first step: the first logged peak counts training, not the build."""
        self.memory.reset()
        self.memory.read()  # finds out whether this system has per-step peaks at all
        if not self.memory.per_step:
            self.info("lctrain: peak_mem_bytes is each rank's lifetime peak: this system does "
                      "not let a process reset its high water mark (/proc/self/clear_refs)")

    def per_step(self, out: dict) -> None:
        """Add this rank's `tflops_per_rank`, `mfu` and the traffic keys to a step's metrics."""
        per_rank = self.flops_per_step / (out["step_time"] * self.rt.world_size)
        out.update(tflops_per_rank=per_rank / 1e12,
                   mfu=mfu(self.flops_per_step, out["step_time"], self.rt.world_size,
                           self.peak_tflops))
        if self.measure_cp:
            out["traffic/cp"] = out["cp_bytes_sent"]
        if self.measure_ep:
            out["traffic/ep"] = out["ep_bytes_sent"]
        out.update(self.traffic)

    def reduce(self, out: dict) -> None:
        """`peak_mem_bytes` and `data_time` as their largest over the ranks (collective)."""
        x = torch.tensor([float(self.memory.read()), out["data_time"]], dtype=torch.float64,
                         device=self.rt.device)
        if self.rt.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        self.memory.reset()
        out.update(peak_mem_bytes=int(x[0].item()), data_time=float(x[1].item()))


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLogger:
    """Decides when to log (`should_log`) and writes every logged step everywhere (rank 0 only).

    metrics.jsonl never holds a torn line: each row is appended with one os.write of the whole
    line, and a failed write (full disk, read-only file system) is cut back to the file's size
    before it and raised as a RunDirError naming the file; training stops rather than go on
    without its metrics."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, rank: int, total_steps: int,
                 config_dict: dict | None = None):
        self.cfg, self.rank, self.total_steps = cfg, rank, total_steps
        self.enabled = rank == 0
        self.run_dir, self.path = run_dir, RunDir(run_dir).metrics
        self._fd: int | None = None
        self._progress = self._task = self._wandb = self._tensorboard = None
        if not self.enabled:
            return
        self._fd = self._open()
        self.console = Console(file=sys.stdout, soft_wrap=True)
        if cfg.progress and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=self.console)
            self._task = self._progress.add_task("train", total=total_steps, status="")
            self._progress.start()
        if cfg.wandb and cfg.wandb_mode != "disabled":
            self._wandb = self._init_wandb(config_dict)

    def _init_wandb(self, config_dict: dict | None):
        """wandb.init continuing the run whose id the run dir holds (a restart), else a new
        run whose id is stored there."""
        try:
            import wandb  # lazy: heavy import, optional at run time
        except ImportError as e:
            raise ImportError("logging.wandb=true needs wandb: pip install wandb (or set "
                              "logging.wandb=false)") from e

        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        run = wandb.init(project=self.cfg.wandb_project, mode=self.cfg.wandb_mode,
                         dir=str(self.run_dir), config=config_dict, id=run_id, resume="allow")
        write_atomic(id_file, run_id + "\n")
        return run

    def _error(self, doing: str, error: OSError, kept: str) -> RunDirError:
        return RunDirError(
            f"cannot {doing} {self.path}: {describe_os_error(error)}; {kept}; training stopped. "
            f"{write_advice({error.errno}, self.run_dir, 'hydra.run.dir')} Then run again with "
            "checkpoint.resume=auto to continue from the newest complete checkpoint.")

    def _open(self) -> int:
        """metrics.jsonl opened for appending (created if missing)."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise self._error("open", e, "it is unchanged") from e

    def _append(self, step: int, line: bytes) -> None:
        """One row, whole or not at all: on a failed or short write the file is truncated back
        to its size before the row, so every line a reader finds parses."""
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
            while written < len(line):  # a short write: the disk filled up within the row
                more = os.write(self._fd, line[written:])
                if more <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += more
        except OSError as e:
            try:
                os.ftruncate(self._fd, size)
                kept = f"its rows before step {step} are whole (the partial row was removed)"
            except OSError:
                kept = (f"its last row (step {step}) may be torn; the next run of this run dir "
                        "drops it")
            raise self._error(f"append the row of step {step} to", e, kept) from e

    def start(self, step: int) -> None:
        """Before the first step, resumed after `step`: metrics.jsonl keeps each step once (the
        rows after `step`, logged by an earlier attempt, are dropped: rewritten atomically), and
        TensorBoard likewise discards its events from step + 1 on (`purge_step`)."""
        if not self.enabled:
            return
        os.close(self._fd)
        self._fd = None
        self._drop_rows_after(step)
        self._fd = self._open()
        if self.cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: the tensorboard extra
            except ImportError as e:
                raise ImportError("logging.tensorboard=true needs tensorboard: pip install "
                                  "tensorboard (or set logging.tensorboard=false)") from e

            self._tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"),
                                              purge_step=step + 1)

    def _drop_rows_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        keep = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):  # a row torn by a killed run
                continue
        if len(keep) == len(lines):
            return
        write_atomic(self.path, "".join(keep))

    def should_log(self, step: int) -> bool:
        """Step is 1-based; the last step is always logged."""
        return step % self.cfg.log_every == 0 or step == self.total_steps

    def log(self, step: int, metrics: dict) -> None:
        """A training step's metrics everywhere (`record`), and its status line."""
        if not self.enabled:
            return
        self.record(step, metrics)
        status = (f"step {step}/{self.total_steps}  loss {metrics['loss']:.4f}  "
                  f"lr {metrics['lr']:.2e}  gnorm {metrics['grad_norm']:.3f}  "
                  f"{metrics['tokens_per_sec']:,.0f} tok/s")
        if "aux_loss" in metrics:
            status += f"  aux {metrics['aux_loss']:.4f}"
        if metrics.get("mfu") is not None:
            status += f"  mfu {100 * metrics['mfu']:.3g}%"
        if "peak_mem_bytes" in metrics:
            status += f"  mem {metrics['peak_mem_bytes'] / 2**30:.2f} GiB"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)
        else:
            self.console.print(status, highlight=False)

    def record(self, step: int, metrics: dict) -> None:
        """`metrics` of `step` into metrics.jsonl, W&B and TensorBoard (what `lctrain eval`
        writes alone: no training status)."""
        if not self.enabled:
            return
        row = {"step": step, **metrics, "time": time.time()}
        self._append(step, (json.dumps(row) + "\n").encode())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items()
                             if v is not None and not isinstance(v, list)}, step=step)
        if self._tensorboard is not None:
            for key, value in _scalars(metrics).items():
                self._tensorboard.add_scalar(key, value, step)

    def info(self, message: str) -> None:
        if self.enabled:
            (self._progress.console if self._progress else self.console).print(message,
                                                                                highlight=False)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
