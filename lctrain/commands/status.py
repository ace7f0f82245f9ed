"""`lctrain status RUN_DIR [RUN_DIR...]`: where a run stands, from its run dir and, when Slurm is
here, from squeue / scontrol / sacct: the state of its newest job, the last logged step, loss,
tokens/s, the time left at the recent rate, and the newest complete checkpoint.

Read-only: nothing in the run dir is changed (its lock is read, never taken), and a run dir that
no job or `lctrain train` has written yet is an error naming what a run dir holds.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import time
from pathlib import Path

from omegaconf import OmegaConf

from lctrain.commands import CommandArgs
from lctrain.config import ConfigError
from lctrain.rundir import CONFIG, RunDir
from lctrain.rundir import lock as run_lock
from lctrain.rundir.checkpoint_dirs import complete_checkpoints
from lctrain.rundir.metrics_log import read_metrics
from lctrain.rundir.rank_records import diagnose, read_records, stopped

RATE_WINDOW = 10
"""Logged steps whose mean step time estimates the time left."""


def job_state(job_id: str) -> str:
    """The job's state as Slurm reports it, from the queue, then the controller's memory of
    finished jobs, then accounting; 'unknown' when none of them knows it."""
    if shutil.which("squeue"):
        out = _ask(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%M"])
        if out:
            state, reason, elapsed = out.split("\n")[0].split("|")
            return f"{state} ({reason}, {elapsed} elapsed)" if state == "PENDING" or \
                reason not in ("None", "") else f"{state} ({elapsed} elapsed)"
    if shutil.which("scontrol"):
        out = _ask(["scontrol", "-o", "show", "job", job_id])
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        if "JobState" in fields:
            return (f"{fields['JobState']} (exit {fields.get('ExitCode', '?')}, restarts "
                    f"{fields.get('Restarts', '0')})")
    if shutil.which("sacct"):
        out = _ask(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
        if out:
            return out.split("\n")[0].replace("|", " (exit ") + ")"
    return "unknown (Slurm no longer reports it)"


def _ask(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _ago(seconds: float) -> str:
    return f"{_duration(seconds)} ago"


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0))))


def describe(run_dir: Path) -> list[tuple[str, str]]:
    """(field, value) rows for one run dir; raises ConfigError when it is not a run dir."""
    run_dir = run_dir.resolve()
    room = RunDir(run_dir)
    config = room.config
    if not config.is_file():
        raise ConfigError([f"{run_dir} is not a run dir: it has no {CONFIG} (a run dir holds "
                           f"{CONFIG}, metrics.jsonl and checkpoints/, written by lctrain train "
                           "or lctrain submit)"], header="no status")
    cfg = OmegaConf.load(config)
    steps = int(cfg.train.steps)
    rows = [("run dir", str(run_dir))]
    jobs = room.jobs.read_text().split() if room.jobs.is_file() else []
    if jobs:
        rows.append(("job", f"{jobs[-1]}: {job_state(jobs[-1])}"
                     + (f"; earlier jobs {', '.join(jobs[:-1])}" if len(jobs) > 1 else "")))
    metrics = read_metrics(room.metrics) if room.metrics.is_file() else []
    metrics = [r for r in metrics if "step_time" in r]  # trained steps (not a step 0 score)
    records = read_records(run_dir)
    stopped = _stopped(records)
    if metrics:
        last = metrics[-1]
        recent = metrics[-RATE_WINDOW:]
        step_time = sum(r["step_time"] for r in recent) / len(recent)
        tokens_per_sec = sum(r["tokens_per_sec"] for r in recent) / len(recent)
        rows += [
            ("step", f"{last['step']} / {steps} ({100 * last['step'] / steps:.0f}%)"),
            ("loss", f"{last['loss']:.4f} at step {last['step']}"),
            ("tokens/s", f"{tokens_per_sec:,.0f} (mean of the last {len(recent)} logged steps)"),
            stopped or ("time left", "none: the last step is done" if last["step"] >= steps
                        else f"{_duration((steps - last['step']) * step_time)} at "
                        f"{step_time:.2f} s/step"),
            ("last logged", _ago(time.time() - last["time"]) if "time" in last else "?"),
        ]
    else:
        rows.append(("step", f"none logged yet (0 / {steps})"))
    root = room.checkpoints(cfg.checkpoint.get("dir"))
    found = complete_checkpoints(root)
    rows.append(("checkpoint", f"{found[0]} ({_ago(time.time() - found[0].stat().st_mtime)})"
                 if found else f"none complete in {root}"))
    rows.append(("lock", lock_row(run_dir)))
    rows += rank_rows(records, time.time())
    if stopped:
        rows.append(("resume", room.resume_command()))
    if room.stop.exists():
        rows.append(("stop file", f"{room.stop}: training stops after its current step"))
    return rows


def _stopped(records: list[dict]) -> tuple[str, str] | None:
    """The row of a run that stopped early: after which step, when and why."""
    first = stopped(records)
    if first is None:
        return None
    return ("stopped", f"after step {first['step']}, {_ago(time.time() - first['written_at'])}"
                       f" ({first.get('stopped_because') or 'reason not recorded'})")


ADVANCING_S = 10.0
"""A live job whose every rank entered a collective or a step within this many seconds is
advancing: who waits for whom at that instant is the ordinary skew of collectives in flight,
not a stall, so no rank is named behind."""


def rank_rows(records: list[dict], now: float) -> list[tuple[str, str]]:
    """The ranks' progress table of a job that is live or ended badly (none when every rank
    finished or stopped), and unless every rank is advancing, who is behind and where."""
    if not any(r["phase"] not in ("done", "stopped") for r in records):
        return []
    behind, lines = diagnose(records, now)
    slowest = max(now - r["advanced_at"] for r in records)
    if slowest <= ADVANCING_S:
        table = lines[:len(records) + 1]  # the waits a snapshot catches are collectives in flight
        return [("ranks", f"{len(records)} progress records; all advancing (the last advance "
                 f"of the slowest rank {slowest:.1f} s ago)"), *(("", line) for line in table)]
    return [("ranks", f"{len(records)} progress records; behind: "
             f"{', '.join(map(str, behind)) or 'none'}"), *(("", line) for line in lines)]


def lock_row(run_dir: Path) -> str:
    """Who holds the run dir's lock, read without touching it (the local clock ages it)."""
    state = run_lock.inspect(run_dir, now=time.time())
    if state is None:
        return "free (no job holds this run dir)"
    h = state.holder
    if state.stale:
        who = h.describe() if h else "an unreadable lock file"
        return f"stale: {who} ({state.why}); the next lctrain train takes it over"
    if h is None:
        return f"held: the lock file is {state.why}"
    job = f" (Slurm job {h.slurm_job_id})" if h.slurm_job_id else ""
    return f"held by {h.host}:{h.pid} since {h.since}{job}; {state.why}"


def run(args: CommandArgs) -> int:
    paths = args.words
    if not paths:
        raise ConfigError(["give one or more run dirs: lctrain status RUN_DIR [RUN_DIR...]"],
                          header="no status")
    blocks = [describe(Path(p)) for p in paths]
    for i, rows in enumerate(blocks):
        if i:
            print()
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
    return 0
