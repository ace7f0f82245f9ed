"""One job per run dir (lctrain.rundir.lock): take and release, refusal naming the holder,
takeover of a dead or silent holder's lock (exactly one of many racers wins), release on
exception and after SIGKILL, the requeued Slurm job's wait for its previous start, `lctrain
status`'s lock row, and `lctrain train` end to end: a second job in a live run dir exits 3 (a
run dir that cannot be written is a configuration error: exit 2)."""

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from lctrain import cli
from lctrain.commands.status import lock_row
from lctrain.config import ConfigError
from lctrain.rundir import lock as run_lock
from lctrain.rundir.lock import LOCK_FILE, Holder, RunDirLocked
from tests.helpers import run_cli

FORK = mp.get_context("fork")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}


def _write_lock(run_dir: Path, holder: Holder, age_s: float = 0.0) -> Path:
    """A lock file as `holder` would have left it, its last heartbeat `age_s` ago."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps(asdict(holder)))
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def _dead_pid() -> int:
    p = FORK.Process(target=lambda: None)
    p.start()
    p.join()
    return p.pid


def _elsewhere(**changes) -> Holder:
    """A holder on another machine."""
    return replace(Holder.this_process(), host="node-elsewhere", boot_id="other-boot",
                   pid=4242, start_time=99, token="feedface" * 4, **changes)


def _leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith(LOCK_FILE))


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path):
    run_dir = tmp_path / "new" / "run"  # created by acquire
    lock = run_lock.acquire(run_dir)
    saved = json.loads((run_dir / LOCK_FILE).read_text())
    assert saved["host"] == socket.gethostname() and saved["pid"] == os.getpid()
    assert saved["start_time"] == run_lock._start_time(os.getpid()) is not None
    assert {"slurm_job_id", "since", "token"} <= saved.keys() and lock.took_over is None
    lock.release()
    assert _leftovers(run_dir) == []
    lock.release()  # idempotent
    with run_lock.acquire(run_dir):  # free again
        assert _leftovers(run_dir) == [LOCK_FILE]
    assert _leftovers(run_dir) == []


def test_second_acquire_is_refused_naming_host_and_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    with run_lock.acquire(tmp_path):
        with pytest.raises(RunDirLocked) as e:
            run_lock.acquire(tmp_path)
        # busy, not misconfigured: its own exit code, not a ConfigError's
        assert not isinstance(e.value, ConfigError) and e.value.header == "the run dir is in use"
        message = e.value.problems[0]
        assert f"host {socket.gethostname()}, pid {os.getpid()}, Slurm job 31337, since" in message
        assert f"hydra.run.dir={tmp_path}" in message and "scancel 31337" in message
        assert "held by" in lock_row(tmp_path) and f":{os.getpid()} since" in lock_row(tmp_path)
    assert lock_row(tmp_path).startswith("free")


def test_cli_exits_3_for_a_run_dir_in_use_and_2_for_one_it_cannot_write(tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.setattr("lctrain.training.loop.train", _refuse)
    monkeypatch.setattr("lctrain.parallel.launch.run_ranks", _refuse)
    train = ["train", "+recipe=tiny", "train.steps=1"]
    with run_lock.acquire(tmp_path / "run"):
        code, _, err = run_cli([*train, f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert code == cli.EXIT_RUN_DIR_LOCKED == 3, err
    assert "lctrain: the run dir is in use:\n  - hydra.run.dir=" in err
    assert f"pid {os.getpid()}" in err
    (tmp_path / "file").write_text("")
    code, _, err = run_cli([*train, f"hydra.run.dir={tmp_path / 'file' / 'run'}"], capsys)
    assert code == cli.EXIT_CONFIG == 2 and "cannot create its lock file" in err, err
    assert "Exit codes: 0 ok, 1 run failure (or data error), 2 configuration error, 3 run dir " \
           "in use by a live job." in cli.usage()


def _refuse(*args, **kwargs):
    raise AssertionError("a refused run dir must start nothing")


def test_release_on_exception(tmp_path):
    with pytest.raises(ValueError), run_lock.acquire(tmp_path):
        raise ValueError("the run failed")
    assert _leftovers(tmp_path) == []


def test_lock_of_a_dead_or_reused_pid_is_taken_over_at_once(tmp_path):
    me = Holder.this_process()
    _write_lock(tmp_path, replace(me, pid=_dead_pid(), token="a" * 32))
    assert lock_row(tmp_path).startswith("stale:")
    with run_lock.acquire(tmp_path) as lock:
        assert "no longer runs on" in lock.took_over
    # pid reuse: this very pid, but a process that started at another time
    _write_lock(tmp_path, replace(me, start_time=me.start_time - 1, token="b" * 32))
    with run_lock.acquire(tmp_path) as lock:
        assert f"pid {os.getpid()} no longer runs" in lock.took_over
    assert _leftovers(tmp_path) == []


def test_lock_from_another_host_is_refused_while_its_heartbeat_is_fresh(tmp_path):
    _write_lock(tmp_path, _elsewhere(slurm_job_id="55"), age_s=2)
    with pytest.raises(RunDirLocked, match=r"host node-elsewhere, pid 4242, Slurm job 55, since"):
        run_lock.acquire(tmp_path)
    _write_lock(tmp_path, _elsewhere(), age_s=run_lock.STALE_AFTER_S + 5)
    assert lock_row(tmp_path).startswith("stale: host node-elsewhere, pid 4242")
    with run_lock.acquire(tmp_path) as lock:
        assert "no heartbeat for" in lock.took_over
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.holder.token


def test_unreadable_lock_is_held_while_young_and_stale_when_old(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")  # created, its holder died before writing
    with pytest.raises(RunDirLocked, match="being written"):
        run_lock.acquire(tmp_path)
    t = time.time() - 100
    os.utime(tmp_path / LOCK_FILE, (t, t))
    with run_lock.acquire(tmp_path) as lock:
        assert lock.took_over.startswith("unreadable")


def test_heartbeat_refreshes_the_lock_and_never_touches_a_successor(tmp_path):
    lock = run_lock.acquire(tmp_path, heartbeat_s=0.05)
    path = tmp_path / LOCK_FILE
    old = time.time() - 50
    os.utime(path, (old, old))
    time.sleep(0.5)
    assert path.stat().st_mtime > old + 40
    _write_lock(tmp_path, _elsewhere())  # taken over after a missed heartbeat
    time.sleep(0.3)
    old = time.time() - 50
    os.utime(path, (old, old))
    time.sleep(0.3)
    assert path.stat().st_mtime < old + 1  # the old holder stopped beating
    lock.release()
    assert json.loads(path.read_text())["host"] == "node-elsewhere"  # and left it in place


def test_abandoned_takeover_marker_is_passed_over(tmp_path):
    _write_lock(tmp_path, _elsewhere(), age_s=100)
    marker = tmp_path / f"{LOCK_FILE}.takeover-{_elsewhere().token}-0"
    marker.touch()
    t = time.time() - 100
    os.utime(marker, (t, t))
    with run_lock.acquire(tmp_path) as lock:
        assert lock.took_over
    assert _leftovers(tmp_path) == []


def test_requeued_slurm_job_waits_for_its_previous_start_then_takes_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    previous = _elsewhere(slurm_job_id="77", slurm_cluster=None, start="0.0")
    _write_lock(tmp_path, previous, age_s=0.5)
    notes = []
    t0 = time.monotonic()
    with run_lock.acquire(tmp_path, heartbeat_s=0.2, stale_after_s=1.0, log=notes.append) as lock:
        assert 0.4 < time.monotonic() - t0 < 5
        assert "previous start" in notes[0] and "no heartbeat" in lock.took_over
    # the same start of the same job, or another job, is refused at once: the id alone never
    # takes a lock with a fresh heartbeat
    for holder in (replace(previous, start="1.0"), replace(previous, slurm_job_id="78")):
        _write_lock(tmp_path, holder)
        t0 = time.monotonic()
        with pytest.raises(RunDirLocked):
            run_lock.acquire(tmp_path, heartbeat_s=0.2, stale_after_s=1.0)
        assert time.monotonic() - t0 < 0.5


def _racer(run_dir, barrier, results, release):
    barrier.wait()
    try:
        lock = run_lock.acquire(run_dir)
    except RunDirLocked:
        results.put("refused")
        return
    results.put("won")
    release.wait(60)
    lock.release()


@pytest.mark.parametrize("stale", ["dead pid", "silent host"])
def test_racers_for_a_stale_lock_exactly_one_wins(tmp_path, stale):
    for round_ in range(5):
        run_dir = tmp_path / str(round_)
        holder = (replace(Holder.this_process(), pid=_dead_pid(), token=f"{round_:032d}")
                  if stale == "dead pid" else _elsewhere())
        _write_lock(run_dir, holder, age_s=0 if stale == "dead pid" else 100)
        barrier, results, release = FORK.Barrier(8), FORK.Queue(), FORK.Event()
        racers = [FORK.Process(target=_racer, args=(run_dir, barrier, results, release))
                  for _ in range(8)]
        for p in racers:
            p.start()
        outcomes = sorted(results.get(timeout=60) for _ in racers)
        release.set()
        for p in racers:
            p.join(30)
        assert outcomes == ["refused"] * 7 + ["won"], (round_, outcomes)
        assert all(p.exitcode == 0 for p in racers)
        assert _leftovers(run_dir) == []  # no lock, marker or probe file left


def _holder(run_dir, ready):
    run_lock.acquire(run_dir)
    ready.set()
    time.sleep(600)


def test_sigkilled_holder_lock_is_taken_at_once(tmp_path):
    ready = FORK.Event()
    p = FORK.Process(target=_holder, args=(tmp_path, ready))
    p.start()
    assert ready.wait(30)
    with pytest.raises(RunDirLocked, match=f"pid {p.pid}"):
        run_lock.acquire(tmp_path)
    os.kill(p.pid, signal.SIGKILL)
    time.sleep(0.2)  # not reaped yet: a zombie counts as dead
    t0 = time.monotonic()
    with run_lock.acquire(tmp_path) as lock:
        assert time.monotonic() - t0 < 2 and f"pid {p.pid} no longer runs" in lock.took_over
    p.join()


def _train(run_dir: Path, name: str, *overrides: str) -> subprocess.Popen:
    """`lctrain train` of the tiny recipe in the background; its output goes to NAME.out/.err
    beside the run dir (a pipe nobody reads would stall a run that logs every step)."""
    cmd = [sys.executable, "-m", "lctrain.cli", "train", "+recipe=tiny", "eval.every=0",
           "logging.log_every=1", f"hydra.run.dir={run_dir}", *overrides]
    with open(run_dir.parent / f"{name}.out", "w") as out, \
            open(run_dir.parent / f"{name}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=run_dir.parent, env=ENV, stdout=out, stderr=err)


def _finish(proc: subprocess.Popen, run_dir: Path, name: str, timeout: float = 300) -> str:
    """Wait for `proc`; its stderr."""
    proc.wait(timeout)
    return (run_dir.parent / f"{name}.err").read_text()


@pytest.mark.slow
def test_second_train_in_a_live_run_dir_exits_3_naming_the_first(tmp_path):
    run_dir = tmp_path / "run"
    first = _train(run_dir, "first", "train.steps=200")
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run logged no step"
            time.sleep(0.5)
        assert lock_row(run_dir).startswith(f"held by {socket.gethostname()}:{first.pid} since")
        second = _train(run_dir, "second", "train.steps=200")
        err = _finish(second, run_dir, "second")
        assert second.returncode == 3, err[-3000:]
        assert "lctrain: the run dir is in use:" in err
        assert f"host {socket.gethostname()}, pid {first.pid}, since" in err
        assert first.poll() is None  # untouched
        first.send_signal(signal.SIGTERM)  # checkpoints after its step and exits 0
        err = _finish(first, run_dir, "first")
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert not (run_dir / LOCK_FILE).exists() and lock_row(run_dir).startswith("free")
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    third = _train(run_dir, "third", f"train.steps={last + 1}", "checkpoint.resume=auto")
    err = _finish(third, run_dir, "third")
    assert third.returncode == 0, err[-3000:]
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == last + 1
    assert not (run_dir / LOCK_FILE).exists()
