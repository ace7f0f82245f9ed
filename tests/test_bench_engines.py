"""bench/engines.py runs end to end at tiny sizes, and the states it measures are those of the
formulas where the engines keep no extra copies: DDP and FSDP exactly, ZeRO-1's full gradients
at the end of the backward, ZeRO-3 with offload nothing sharded on the device but its
persistent parameters, all of its state on the host."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload")


def test_bench_runs_and_matches_the_formulas_where_it_should():
    cmd = [sys.executable, "bench/engines.py", "--dp", "2", "--dim", "64", "--vocab", "512",
           "--layers", "2", "--seq-len", "16", "--steps", "1", "--warmup", "1", "--no-details"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows: dict[str, list[list[float]]] = {}
    for line in out.stdout.splitlines():
        cells = line.split()
        if cells and cells[0] in ENGINES:
            rows.setdefault(cells[0], []).append([float(c) for c in cells[3:15]])
    assert {name: len(r) for name, r in rows.items()} == dict.fromkeys(ENGINES, 2), out.stdout
    # columns: weights, grads, optimizer, device total (meas, form, plan), host (meas, form)
    for name in ("ddp", "fsdp"):
        for row in rows[name]:
            assert row[0] == row[1] and row[2] == row[3] and row[4] == row[5], row
            assert row[6] == row[7] == row[8], row
    for row in rows["zero1"]:
        assert row[2] == row[3] and row[4] == row[5], row  # full grads, sharded moments
        assert row[0] > row[1], row  # + the fp32 master partition
    for row in rows["zero3_offload"]:
        assert row[4] == 0 and row[9] >= row[10] > 0, row
