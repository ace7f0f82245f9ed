"""Faults injected into real runs (bench/faults.py's scenarios, asserted): the launcher killed
with SIGKILL takes its ranks with it; a rank stopped with SIGSTOP ends the job within
launch.timeout_s with a report naming it; no process is left, every complete checkpoint still
verifies, and the next run resumes. The progress records and the report are also checked on
their own."""

import pytest

from bench.faults import agent_sigkill, parent_sigkill, rank_sigstop
from lctrain.parallel.progress import diagnose, stall_report

TIMEOUT_S = 6


def assert_meets_goal(row, limit_s: float) -> None:
    assert row.detected, row
    assert row.seconds <= limit_s, row
    assert row.processes_left == 0 and row.data_lost == 0, row
    assert row.resumed, row


def test_ranks_die_with_their_launcher(tmp_path):
    assert_meets_goal(parent_sigkill(tmp_path), limit_s=5)
    assert_meets_goal(agent_sigkill(tmp_path), limit_s=5)


@pytest.mark.parametrize("group", ["tp", "cp_ring", "pp"])
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path, group):
    assert_meets_goal(rank_sigstop(tmp_path, group, TIMEOUT_S), limit_s=TIMEOUT_S + 10)


def record(rank, step, seq, written_ago=0.1, advanced_ago=0.1, phase="train", groups=None):
    now = 1000.0
    return {"rank": rank, "host": "h", "pid": 100 + rank, "step": step, "micro_step": 0,
            "phase": phase, "seq": seq, "groups": groups or {"dp": [0, 1], "cp": [0, 1]},
            "written_at": now - written_ago, "advanced_at": now - advanced_ago}


def test_diagnosis_blames_the_rank_that_did_not_arrive_not_its_victims():
    groups = {0: {"cp": [0, 1], "dp": [0, 2]}, 1: {"cp": [0, 1], "dp": [1, 3]},
              2: {"cp": [2, 3], "dp": [0, 2]}, 3: {"cp": [2, 3], "dp": [1, 3]}}
    records = [  # rank 3 stopped; rank 2 waits for it in cp, ranks 0/1 wait in dp
        record(0, 5, {"cp": 40, "dp": 11}, groups=groups[0]),
        record(1, 5, {"cp": 40, "dp": 11}, groups=groups[1]),
        record(2, 5, {"cp": 41, "dp": 10}, groups=groups[2]),
        record(3, 5, {"cp": 40, "dp": 10}, groups=groups[3]),
    ]
    behind, lines = diagnose(records, now=1000.0)
    assert behind == [3]
    assert "  group cp [2, 3]: rank(s) [2] entered collective #41; rank(s) [3] did not (at #40)" \
        in lines
    records[3] = record(3, 5, {"cp": 40, "dp": 10}, written_ago=30, advanced_ago=30,
                        groups=groups[3])
    report = stall_report(records, "test", now=1000.0)
    assert "<- not responding" in report and report.endswith(
        "behind: rank 3 (h pid 103) at step 5 micro-step 0 (train)")
    # a rank that left with its own error (a full disk) is not behind: its error says why
    failed = [*records[:3], record(3, 5, {"cp": 40, "dp": 10}, phase="failed", written_ago=30,
                                   advanced_ago=30, groups=groups[3])]
    assert diagnose(failed, now=1000.0)[0] == []
    # everyone at the same sequence numbers: nobody to blame, and the report says so
    even = [record(k, 5, {"cp": 40, "dp": 10}, groups=groups[k]) for k in range(4)]
    assert diagnose(even, now=1000.0)[0] == []
    assert "no rank is behind" in stall_report(even, "test", now=1000.0)
