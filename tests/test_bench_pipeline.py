"""bench/pipeline.py: its replay of a recorded op order gives the textbook bubble, and the bench
runs end to end at tiny sizes with the executed orders of 1f1b and zero_bubble replaying to
their formulas."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.pipeline import Op, replay
from lctrain.layout.stages import bubble_fraction

REPO = Path(__file__).resolve().parents[1]
UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _op(kind: str, stage: int, mb: int) -> Op:
    return Op(kind, stage, mb, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("pp,m", [(2, 2), (3, 5)])
def test_replay_of_gpipe_order_gives_the_formula(pp, m):
    orders = [[_op("F", r, i) for i in range(m)] + [_op("B", r, i) for i in range(m)]
              for r in range(pp)]
    span, bubbles = replay(orders, lambda op: UNIT[op.kind])
    assert span == 3 * (m + pp - 1)
    assert bubbles == pytest.approx([bubble_fraction("gpipe", pp, m)] * pp)


def test_replay_refuses_an_order_missing_an_op():
    orders = [[_op("F", 0, 0), _op("B", 0, 0)], [_op("B", 1, 0)]]  # stage 1 never runs F
    with pytest.raises(AssertionError, match="an op is missing"):
        replay(orders, lambda op: UNIT[op.kind])


@pytest.mark.slow  # 4 s on 2 cores: the bench script in a subprocess
def test_bench_runs_and_executed_orders_match_their_formulas():
    cmd = [sys.executable, "bench/pipeline.py", "--pp", "2", "--schedules", "1f1b",
           "zero_bubble", "zbv", "--layers", "4", "--seq-len", "32", "--microbatches", "4",
           "--steps", "1", "--warmup", "1"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in ("1f1b", "zero_bubble", "zbv")}
    assert set(rows) == {"1f1b", "zero_bubble", "zbv"}, out.stdout
    for schedule in ("1f1b", "zero_bubble", "zbv"):
        formula, order = float(rows[schedule][4]), float(rows[schedule][5])
        assert order == pytest.approx(formula, abs=1e-3), rows[schedule]
    for row in rows.values():
        assert all(0 <= float(x) < 1 for x in row[4:9]), row
