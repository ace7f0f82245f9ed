"""Preemption: SIGTERM / SIGUSR1 on any rank, or a stop file in the run dir, turned into one
decision that every rank takes after the same step (checkpoint, then exit 0)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from lctrain.parallel.launch import STOP_SIGNALS
from lctrain.parallel.runtime import Runtime


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
        if rank == 0 and stop_file.exists():  # left by the run this one resumes
            stop_file.unlink()

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
        return any(flags)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
