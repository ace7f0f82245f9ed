"""Where every rank is, cheaply, for diagnosing a stalled job: this rank's progress record
(`lctrain.rundir.rank_records` says what it holds and reads it), written by a daemon thread.

The record, RUN_DIR/.progress/rank-NNNNN.json, is memory-mapped: the thread rewrites it every
INTERVAL_S (a memcpy, no system call) with the step, micro-step and phase the training loop
marked (`mark`) and each group's sequence number, read from the process group itself (torch
counts the collectives every backend issues, FSDP's and DTensor's included, so nothing wraps a
collective). With stall_s set, the thread also watches every rank's record and ends the job with
a stall report when none has advanced for that long.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from lctrain.rundir import RunDir
from lctrain.rundir.rank_records import (
    INTERVAL_S,
    RECORD_BYTES,
    read_records,
    stall_report,
    stalled_for,
    write_report,
)

_current: ProgressRecord | None = None


def mark(**fields) -> None:
    """Record where this rank is (step, micro_step, phase); free when no record is open."""
    if _current is not None:
        _current.fields.update(fields)


@dataclass(frozen=True)
class Group:
    name: str
    ranks: tuple[int, ...]
    pg: object


def named_groups(meshes: dict | None) -> list[Group]:
    """The distinct process groups of a rank's named meshes (several names may share one)."""
    if not meshes:
        return []
    seen: dict[int, Group] = {}
    for name, mesh in meshes.items():
        if mesh.size() < 2:
            continue
        pg = mesh.get_group()
        if id(pg) in seen:
            old = seen[id(pg)]
            seen[id(pg)] = Group(f"{old.name}/{name}", old.ranks, pg)
        else:
            seen[id(pg)] = Group(name, tuple(dist.get_process_group_ranks(pg)), pg)
    return list(seen.values())


def _sequence(pg) -> int | None:
    try:
        return int(pg._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):  # a backend that does not count
        return None


class ProgressRecord:
    """This rank's record (see the module docstring); `close` writes the final phase."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, groups: list[Group],
                 stall_s: float = 0.0):
        """stall_s > 0: this rank also watches every record and ends the process with a stall
        report when no rank has advanced for that long (rank 0 under torchrun or srun; the
        local launcher watches its ranks itself)."""
        global _current
        self.run_dir, self.rank, self.groups, self.stall_s = run_dir, rank, groups, stall_s
        directory = RunDir(run_dir).progress
        directory.mkdir(parents=True, exist_ok=True)
        if rank == 0:  # records of ranks a previous, larger world left behind
            for stale in directory.glob("rank-*.json"):
                if int(stale.stem.split("-")[1]) >= world_size:
                    stale.unlink(missing_ok=True)
        self.path = directory / f"rank-{rank:05d}.json"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, RECORD_BYTES)
            self._map = mmap.mmap(fd, RECORD_BYTES)
        finally:
            os.close(fd)
        now = time.time()
        self.fields = {"step": 0, "micro_step": 0, "phase": "start"}
        self.static = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                       "groups": {g.name: list(g.ranks) for g in groups}, "started_at": now}
        self._last: tuple | None = None
        self._advanced_at = now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.write()
        self._thread = threading.Thread(target=self._run, name="lctrain-progress", daemon=True)
        self._thread.start()
        _current = self

    def write(self) -> None:
        with self._lock:
            if self._map.closed:
                return
            seqs = {g.name: _sequence(g.pg) for g in self.groups}
            state = (tuple(self.fields.items()), tuple(seqs.items()))
            now = time.time()
            if state != self._last:
                self._last, self._advanced_at = state, now
            record = {**self.static, **self.fields, "seq": seqs,
                      "advanced_at": self._advanced_at, "written_at": now}
            data = json.dumps(record).encode()[:RECORD_BYTES - 1]
            self._map[:] = data + b"\n" + b" " * (RECORD_BYTES - len(data) - 1)

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self.write()
            if self.stall_s:
                self._watch()

    def _watch(self) -> None:
        records = read_records(self.run_dir)
        idle = stalled_for(records)
        if idle > self.stall_s:
            report = stall_report(records, f"no rank advanced for {idle:.0f} s; "
                                           f"launch.stall_s={self.stall_s:g}")
            write_report(self.run_dir, report)
            print(f"{report}\nlctrain: ending the job (report in "
                  f"{RunDir(self.run_dir).stall_report})", file=sys.stderr, flush=True)
            os._exit(1)  # from this thread: the main thread is stuck; torchrun ends the rest

    def close(self, phase: str) -> None:
        global _current
        self._stop.set()
        self._thread.join()
        self.fields["phase"] = phase
        self.write()
        with self._lock:
            self._map.close()
        if _current is self:
            _current = None
