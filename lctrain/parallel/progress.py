"""Where every rank is, cheaply, for diagnosing a stalled job: each rank's step, micro-step and
phase, and per process group the sequence number of the last collective it entered.

Each rank owns one fixed-size record, RUN_DIR/.progress/rank-NNNNN.json, memory-mapped: a daemon
thread rewrites it every `INTERVAL_S` (a memcpy, no system call) with the step, micro-step and
phase the training loop marked (`mark`) and each group's sequence number, read from the process
group itself (torch counts the collectives every backend issues, FSDP's and DTensor's included,
so nothing wraps a collective). `advanced_at` is the last time any of those changed; `written_at`
the last time the thread ran. A rank blocked in a collective keeps writing (its `written_at`
moves, its `advanced_at` does not); a stopped or wedged process stops writing altogether.

`stall_report` reads every rank's record and says which ranks are behind, where they were, and
which collective the others are waiting in: in each group, the ranks at the highest sequence
number have entered a collective that the ranks below it never reached. The local launcher
builds it when a rank fails or when no rank has advanced for launch.stall_s, rank 0's thread
under torchrun/srun, and `lctrain status` for a live job.
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

RECORD_BYTES = 8192
INTERVAL_S = 0.5
PROGRESS_DIR = ".progress"
REPORT_FILE = "stall-report.txt"
ENDED = ("done", "stopped", "failed")
"""Phases of a rank that left training (its record's last write)."""

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
        directory = run_dir / PROGRESS_DIR
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
                  f"{self.run_dir / REPORT_FILE})", file=sys.stderr, flush=True)
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


def read_records(run_dir: Path) -> list[dict]:
    """Every rank's last record, by rank (a record caught mid-write is read again)."""
    records = []
    for path in sorted((run_dir / PROGRESS_DIR).glob("rank-*.json")):
        for _ in range(5):
            try:
                records.append(json.loads(path.read_bytes().strip() or b"null"))
                break
            except (json.JSONDecodeError, OSError):
                time.sleep(0.01)  # the owner was rewriting it
    return [r for r in records if r]


def stalled_for(records: list[dict], now: float | None = None) -> float:
    """Seconds since any rank last advanced (0 without records)."""
    if not records:
        return 0.0
    return (now or time.time()) - max(r["advanced_at"] for r in records)


def diagnose(records: list[dict], now: float | None = None) -> tuple[list[int], list[str]]:
    """(ranks behind, report lines): the ranks that stopped writing their record, and in each
    group the ranks below the highest sequence number, which the others wait for."""
    now = now or time.time()
    lines = [f"  {'rank':>4} {'host':<12} {'pid':>7} {'step':>6} {'micro':>5} {'phase':<10} "
             f"{'advanced':>10} {'updated':>10}"]
    silent = {r["rank"] for r in records if now - r["written_at"] > 5 * INTERVAL_S + 2
              and r["phase"] not in ENDED}
    for r in records:
        note = "  <- not responding: stopped, hung, or dead" if r["rank"] in silent else ""
        lines.append(f"  {r['rank']:>4} {r['host'][:12]:<12} {r['pid']:>7} {r['step']:>6} "
                     f"{r['micro_step']:>5} {r['phase'][:10]:<10} "
                     f"{now - r['advanced_at']:>9.1f}s {now - r['written_at']:>9.1f}s{note}")
    by_rank = {r["rank"]: r for r in records}
    instances = sorted({(name, tuple(ranks)) for r in records
                        for name, ranks in r["groups"].items()})
    waits, late_ranks, waiting_ranks = [], set(), set()
    for name, ranks in instances:
        known = {k: by_rank[k]["seq"].get(name) for k in ranks if k in by_rank}
        known = {k: s for k, s in known.items() if s is not None}
        if len(set(known.values())) < 2:
            continue
        top = max(known.values())
        late = sorted(k for k, s in known.items() if s < top)
        late_ranks.update(late)
        waiting_ranks.update(k for k, s in known.items() if s == top)
        waits.append(f"  group {name} {list(ranks)}: rank(s) "
                     f"{sorted(k for k, s in known.items() if s == top)} entered collective "
                     f"#{top}; rank(s) {late} did not (at #{min(known[k] for k in late)})")
    if waits:
        lines += ["waiting:", *waits]
    # a rank late in one group but itself waiting in another is a victim, not the cause; a
    # rank that ended (its own error, or done) is not behind: its error says why it left
    ended = {r["rank"] for r in records if r["phase"] in ENDED}
    behind = silent | ((late_ranks - waiting_ranks or late_ranks) - ended)
    if behind:
        lines.append("behind: " + "; ".join(
            f"rank {k} ({by_rank[k]['host']} pid {by_rank[k]['pid']}) at step "
            f"{by_rank[k]['step']} micro-step {by_rank[k]['micro_step']} "
            f"({by_rank[k]['phase']})" for k in sorted(behind)))
    else:
        lines.append("behind: no rank is behind in any group's collectives: every rank waits "
                     "at the same point (the filesystem, the data loader, or a deadlock outside "
                     "collectives)")
    return sorted(behind), lines


def stall_report(records: list[dict], why: str, now: float | None = None) -> str:
    """`diagnose` as text, headed by why it was made."""
    return "\n".join([f"lctrain: stall report ({why})", *diagnose(records, now)[1]])


def write_report(run_dir: Path, report: str) -> Path:
    path = run_dir / REPORT_FILE
    path.write_text(report + "\n")
    return path
