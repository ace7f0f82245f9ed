"""Preemption: SIGTERM / SIGUSR1 on any rank, or a stop file in the run dir, turned into one
decision that every rank takes after the same step (checkpoint, then exit 0).

The stop file belongs to one start of one job: lctrain's batch script writes the job's token
(`job_token`: Slurm job id and restart count) into RUN_DIR/STOP. A run removes, at start, a stop
file that is not its own (left by the job it requeues or resumes, or touched by hand before it
started) and keeps one written for its own token while it was starting up. When a run stops
early it writes its token into RUN_DIR/STOPPED, which the batch script reads to decide on a
requeue: a USR1 that arrives after the last step (the run completed; STOPPED is absent) never
requeues a finished job.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from lctrain.parallel.launch import STOP_SIGNALS
from lctrain.parallel.runtime import Runtime

STOPPED = "STOPPED"
"""Beside the stop file: the token of the start that stopped early (the batch script requeues
that start only)."""


class PreemptionWatcher:
    """Turns SIGTERM / SIGUSR1 on any rank, or a stop file (touched by lctrain's sbatch script
    when SLURM warns), into one decision taken by every rank after the same step."""

    def __init__(self, stop_file: Path, rank: int):
        self.stop_file, self.rank = stop_file, rank
        self.reason: str | None = None
        """Why the run stops (None while it does not)."""
        self._signal: str | None = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        self.stopped_file = stop_file.with_name(STOPPED)
        if rank == 0:
            self.stopped_file.unlink(missing_ok=True)  # the record of the start before this
            if stop_file.exists() and _read(stop_file) != job_token():
                stop_file.unlink()  # not this job's: left by the run this one resumes

    def _handle(self, signum, frame) -> None:
        self._signal = signal.Signals(signum).name

    def requested(self, rt: Runtime) -> bool:
        """Collective: True on every rank once any rank got a signal or rank 0 sees the file."""
        flags = [int(self._signal is not None),
                 int(self.rank == 0 and self.stop_file.exists())]
        if rt.world_size > 1:
            box = torch.tensor(flags, device=rt.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            flags = box.tolist()
        if any(flags) and self.reason is None:
            self.reason = (f"{self._signal} received" if self._signal else
                           "a stop signal on another rank" if flags[0] else
                           f"{self.stop_file} exists")
            if self.rank == 0:
                self.stopped_file.write_text(f"{job_token() or ''}\n")
        return any(flags)

    def completed(self) -> None:
        """Training reached its last step: nothing to requeue, whatever stop came late."""
        if self.rank == 0:
            self.stop_file.unlink(missing_ok=True)
            self.stopped_file.unlink(missing_ok=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def job_token() -> str | None:
    """This start of this Slurm job, as the batch script's USR1 trap writes it; None outside
    Slurm."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT') or '0'}" if job else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
