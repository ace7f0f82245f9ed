"""The progress records of a run's ranks, read without torch: each rank's step, micro-step and
phase, and per process group the sequence number of the last collective it entered, and what
they say about a stalled job.

Each rank owns one fixed-size record, RUN_DIR/.progress/rank-NNNNN.json (RECORD_BYTES, one JSON
object padded with spaces), which its own thread rewrites every INTERVAL_S
(`lctrain.training.progress` writes them). `advanced_at` is the last time the rank's place
changed; `written_at` the last time its thread ran. A rank blocked in a collective keeps writing
(its `written_at` moves, its `advanced_at` does not); a stopped or wedged process stops writing
altogether.

`stall_report` reads every rank's record and says which ranks are behind, where they were, and
which collective the others are waiting in: in each group, the ranks at the highest sequence
number have entered a collective that the ranks below it never reached. The local launcher
builds it when a rank fails or when no rank has advanced for launch.stall_s, rank 0's thread
under torchrun/srun, and `lctrain status` for a live job.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lctrain.rundir import RunDir

RECORD_BYTES = 8192
INTERVAL_S = 0.5
ENDED = ("done", "stopped", "failed")
"""Phases of a rank that left training (its record's last write)."""


def stopped(records: list[dict]) -> dict | None:
    """The record (of the lowest rank) of a run whose ranks all ended and stopped early (a
    signal, a STOP file, the time limit; `stopped_because` says which when recorded); None
    while a rank runs, or when none stopped."""
    if not records or any(r["phase"] not in ENDED for r in records):
        return None
    return min((r for r in records if r["phase"] == "stopped"), key=lambda r: r["rank"],
               default=None)


def read_records(run_dir: Path) -> list[dict]:
    """Every rank's last record, by rank (a record caught mid-write is read again)."""
    records = []
    for path in sorted(RunDir(run_dir).progress.glob("rank-*.json")):
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
    path = RunDir(run_dir).stall_report
    path.write_text(report + "\n")
    return path
