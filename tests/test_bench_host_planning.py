"""bench/host_planning.py end to end at a small size: every (split, model) row planned and set
beside the attention time of its busiest rank, and that attention agrees with the layout: the
documents split's busiest rank computes no more than zigzag's, and window layers cost less
than full ones (the bench asserts nothing about its own timings)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 5 s on 2 cores
def test_host_planning_rows():
    cmd = [sys.executable, "bench/host_planning.py", "--seq-len", "65536", "--cp", "4",
           "--repeats", "1", "--json"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["balance"], r["model"]): r for r in json.loads(out.stdout)}
    assert set(rows) == {(b, m) for b in ("zigzag", "documents")
                         for m in ("dense", "window 4096")}
    assert all(r["planning_ms"] > 0 and r["calls"] > 0 for r in rows.values())
    for model in ("dense", "window 4096"):
        assert rows["documents", model]["attention_ms"] <= rows["zigzag", model]["attention_ms"]
    for balance in ("zigzag", "documents"):
        assert rows[balance, "window 4096"]["attention_ms"] < rows[balance, "dense"]["attention_ms"]
