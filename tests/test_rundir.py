"""The run directory's room (lctrain.rundir): one home for the names of a run's files and for
where its checkpoints go, importable without torch; `lctrain submit` writes config.yaml whole
through it, as `lctrain train` does."""

from __future__ import annotations

import subprocess
import sys
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


def test_the_room_imports_no_torch():
    code = "import sys, lctrain.rundir, lctrain.rundir.files; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


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
