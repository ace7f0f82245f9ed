"""The run directory's room (lctrain.rundir): one home for the names of a run's files and for
where its checkpoints go, importable without torch; `lctrain submit` writes config.yaml whole
through it, as `lctrain train` does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from lctrain.config.compose import compose
from lctrain.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]


def test_the_room_names_every_file_and_where_checkpoints_go(tmp_path):
    room = RunDir(str(tmp_path))
    assert (room.config, room.metrics, room.stop, room.jobs) == (
        tmp_path / "config.yaml", tmp_path / "metrics.jsonl", tmp_path / "STOP",
        tmp_path / "slurm_jobs")
    assert room.checkpoints() == room.checkpoints(None) == tmp_path / "checkpoints"
    assert room.checkpoints("/elsewhere/ckpt") == Path("/elsewhere/ckpt")


def test_the_room_names_the_lock_progress_and_report(tmp_path):
    room = RunDir(tmp_path)
    assert (room.lock, room.progress, room.stall_report) == (
        tmp_path / ".lctrain.lock", tmp_path / ".progress", tmp_path / "stall-report.txt")


READ_WITHOUT_TORCH = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ImportError("torch is blocked by tests/test_rundir.py")

sys.meta_path.insert(0, Blocked())
from lctrain.cli import main
for command in " ".join(sys.argv[1:]).split(" ; "):  # lctrain status, then lctrain plot
    try:
        main(command.split())
    except SystemExit as e:
        assert e.code == 0, (command, e.code)
"""


def _finished_run(run_dir: Path) -> None:
    """What a live run leaves: its config, two logged steps, a complete checkpoint, its one
    rank's progress record, and its lock (held by this process)."""
    from lctrain.config.resolved import to_yaml
    from lctrain.rundir import lock, rank_records

    composed = compose(["+recipe=tiny", f"hydra.run.dir={run_dir}"])
    room = RunDir(run_dir)
    run_dir.mkdir()
    room.config.write_text(to_yaml(composed.cfg))
    room.metrics.write_text("".join(
        json.dumps({"step": s, "loss": 3.0 - s, "step_time": 0.5, "tokens_per_sec": 1000.0,
                    "time": 0.0}) + "\n" for s in (1, 2)))
    step = room.checkpoints() / "step-00000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text('{"step": 2, "files": {}}')
    room.progress.mkdir()
    (room.progress / "rank-00000.json").write_text(json.dumps({
        "rank": 0, "host": "h", "pid": 1, "groups": {}, "seq": {}, "step": 2, "micro_step": 0,
        "phase": "train", "advanced_at": time.time(), "written_at": time.time()}).ljust(rank_records.RECORD_BYTES))
    return lock.acquire(run_dir)


def test_status_and_plot_read_a_run_without_torch(tmp_path):
    run_dir = tmp_path / "run"
    with _finished_run(run_dir):
        out = subprocess.run([sys.executable, "-c", READ_WITHOUT_TORCH, "status", str(run_dir),
                              ";", "plot", str(run_dir), f"--out={tmp_path / 'plots'}"],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "2 / " in out.stdout and "step-00000002" in out.stdout
        assert f"held by {socket.gethostname()}:{os.getpid()}" in out.stdout
        assert "1 progress records; all advancing" in out.stdout
    assert (tmp_path / "plots" / "loss.png").is_file()


def test_submit_writes_its_config_whole_and_records_the_job(tmp_path):
    from lctrain.commands.submit import submit

    sbatch = tmp_path / "sbatch"
    sbatch.write_text("#!/bin/sh\necho '4242;cluster'\n")
    sbatch.chmod(0o755)
    composed = compose(["+recipe=tiny", f"hydra.run.dir={tmp_path / 'run'}"])
    assert submit(composed, str(sbatch)) == "4242"
    room = RunDir(tmp_path / "run")
    assert "parallel:" in room.config.read_text() and room.jobs.read_text() == "4242\n"
    assert not [p for p in room.path.iterdir() if p.name.startswith(".")]  # no temp file left
