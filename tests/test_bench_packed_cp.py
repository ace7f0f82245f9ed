"""bench/packed_cp.py end to end at tiny sizes: on every mix the split by documents balances the
causal work at least as well as zigzag, within 5% for Ring at cp 4, sends no more than zigzag
sending every K/V, and the timed rows ran (the bench itself asserts that the counted work equals
`split_cost` and that each timed variant sent what the traffic formula says at its share)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lctrain.layout.packed import LENGTH_MIXES

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 10 s on 2 cores: 3 mixes counted at cp 2 and 4, 6 small launches timed
def test_documents_balance_and_send_no_worse_than_zigzag():
    cmd = [sys.executable, "bench/packed_cp.py", "--seq-len", "4096", "--rows", "2", "--cp", "2",
           "4", "--time-seq-len", "1024", "--repeats", "1", "--json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    by = {(r["mix"], r["cp"], r["algorithm"], r["ulysses"], r["load_balance"], r["kv"]): r
          for r in rows}
    assert {r["mix"] for r in rows} == set(LENGTH_MIXES) and {r["cp"] for r in rows} == {2, 4}
    for row in (r for r in rows if r["load_balance"] == "documents"):
        layout = (row["mix"], row["cp"], row["algorithm"], row["ulysses"])
        zigzag, zigzag_all = by[(*layout, "zigzag", "travelling")], by[(*layout, "zigzag", "all")]
        assert row["work_max_over_mean"] <= zigzag["work_max_over_mean"], (row, zigzag)
        assert row["sent_elements_max"] <= zigzag_all["sent_elements_max"], (row, zigzag_all)
    for mix in LENGTH_MIXES:
        assert by[mix, 4, "ring", 1, "documents", "travelling"]["work_max_over_mean"] <= 1.05
    timed = [r for r in rows if "seconds" in r]
    assert {(r["cp"], r["algorithm"]) for r in timed} == {
        (2, "ring"), (2, "allgather"), (4, "ring"), (4, "allgather"), (4, "usp")}
    assert len(timed) == 3 * 5 * 3 and all(r["seconds"] > 0 for r in timed)
