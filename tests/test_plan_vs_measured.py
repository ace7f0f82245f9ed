"""bench/plan_vs_measured.py end to end at a short sequence, in layouts that between them use
every dimension and algorithm (tp with and without SP, and without a data-parallel engine; USP,
whose ring and Ulysses parts are the plain algorithms; all-gather KV; a ring under interleaved
pipelining and GPipe; FSDP and DDP; every checkpointing mode): the traffic lctrain train logs
equals the plan's prediction for every key, one micro-batch's activations equal the formulas
byte for byte, and every rank's live weights, gradients and AdamW state are within 1% of
`state_parts` (the AdamW step counters are the difference). The bench runs all 24 layouts;
step times are its business, not a test's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAMES = ["tp2_cp2_ulysses", "tp2_sp_dp2_sel", "cp4_usp_full", "cp2_allgather_dp2", "dp4_ddp_full",
         "pp2_cp2_interleaved", "pp4_gpipe_full", "tp2_nosp"]


@pytest.mark.slow  # 19 s on 2 cores: the bench trains 8 layouts of up to 4 ranks
def test_every_layout_matches_the_plan(tmp_path):
    out_json = tmp_path / "rows.json"
    cmd = [sys.executable, "bench/plan_vs_measured.py", "--no-time", "--steps", "2",
           "--seq-len", "32", "--json", str(out_json), "--only", *NAMES]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out_json.read_text())
    assert [r["layout"] for r in rows] == NAMES
    for row in rows:
        where = row["layout"]
        assert row["traffic_exact"], (where, row["traffic_logged"], row["traffic_predicted"])
        assert row["act_measured"] == row["act_predicted"], where
        assert abs(row["state_worst_ratio"] - 1) < 0.01, where
        assert "time_ratio" not in row
    logged = {k for r in rows for k, v in r["traffic_logged"].items() if v > 0}
    assert logged >= {"traffic/tp", "traffic/cp", "traffic/pp", "traffic/dp"}, logged
    # the table printed has one line per layout, each saying the traffic is exact
    lines = [line for line in out.stdout.splitlines() if line.split()[:1] in
             ([r["layout"]] for r in rows)]
    assert len(lines) == len(NAMES) and all(" exact " in line for line in lines), out.stdout
