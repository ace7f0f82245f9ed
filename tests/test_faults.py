"""Faults injected into real runs (bench/faults.py's scenarios, asserted): the launcher killed
with SIGKILL takes its ranks with it; a rank stopped with SIGSTOP ends the job within
launch.timeout_s with a report naming it; no process is left, every complete checkpoint still
verifies, and the next run resumes (slow tier: a real run each). The progress records, the
report and the subgroups' collective timeout are also checked on their own."""

import functools
import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.faults import agent_sigkill, parent_sigkill, rank_sigstop
from lctrain.commands.status import rank_rows
from lctrain.parallel.launch import run_ranks
from lctrain.rundir.rank_records import diagnose, stall_report

TIMEOUT_S = 6


def assert_meets_goal(row, limit_s: float) -> None:
    assert row.detected, row
    assert row.seconds <= limit_s, row
    assert row.processes_left == 0 and row.data_lost == 0, row
    assert row.resumed, row


def side_by_side(*scenarios) -> list:
    """The scenarios' rows, run at once: each mostly waits (for its ranks to start, its
    timeout, its processes to go), so side by side they take about as long as the longest."""
    with ThreadPoolExecutor(len(scenarios)) as pool:
        return list(pool.map(lambda scenario: scenario(), scenarios))


@pytest.mark.slow  # 12 s on 2 cores: two launchers killed mid-run, each run resumed
def test_ranks_die_with_their_launcher(tmp_path):
    for row in side_by_side(functools.partial(parent_sigkill, tmp_path),
                            functools.partial(agent_sigkill, tmp_path)):
        assert_meets_goal(row, limit_s=5)


@pytest.mark.slow  # 20 s on 2 cores: for each group a run, its stall timeout, a resumed run
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path):
    groups = ("tp", "cp_ring", "pp")
    rows = side_by_side(*(functools.partial(rank_sigstop, tmp_path, g, TIMEOUT_S) for g in groups))
    for group, row in zip(groups, rows):
        assert row.fault.endswith(f"({group} group; launch.timeout_s={TIMEOUT_S})"), row
        assert_meets_goal(row, limit_s=TIMEOUT_S + 10)


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


def test_status_names_no_rank_behind_while_every_rank_advances():
    groups = {0: {"cp": [0, 1]}, 1: {"cp": [0, 1]}}
    skewed = [record(0, 5, {"cp": 41}, groups=groups[0]),  # a collective in flight
              record(1, 5, {"cp": 40}, groups=groups[1], advanced_ago=0.5)]
    rows = rank_rows(skewed, now=1000.0)
    assert rows[0] == ("ranks", "2 progress records; all advancing (the last advance of the "
                                "slowest rank 0.5 s ago)")
    assert not any("behind" in value or "waiting" in value for _, value in rows)
    stalled = [skewed[0], record(1, 5, {"cp": 40}, groups=groups[1], advanced_ago=30)]
    rows = rank_rows(stalled, now=1000.0)
    assert rows[0] == ("ranks", "2 progress records; behind: 1")
    assert rows[-1][1].startswith("behind: rank 1")
    done = [record(k, 12, {"cp": 50}, phase="done", groups=groups[k]) for k in (0, 1)]
    assert rank_rows(done, now=1000.0) == []


def _wait_in_a_subgroup(gave_up, seconds: float):
    import time

    import torch
    import torch.distributed as dist

    from lctrain.layout.topology import Topology
    from lctrain.parallel.runtime import build_mesh

    mesh = build_mesh(Topology(pp=1, dp=2, cp_ring=2, cp_ulysses=1, tp=1), "cpu")
    timeouts = {name: m.get_group()._get_backend(torch.device("cpu")).options._timeout
                .total_seconds() for name, m in mesh.meshes.items()}
    if dist.get_rank() == 1:  # never joins its cp_ring group's collective
        gave_up.wait(seconds)  # until rank 0 gave up on it
        return timeouts, None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.group("cp_ring"))
    except RuntimeError:
        gave_up.set()
        return timeouts, time.monotonic() - t0
    return timeouts, None


def test_every_subgroup_keeps_the_collective_timeout():
    """torch gives a group made without options a 30-minute timeout: the mesh's groups (cp_ring
    [0, 1] here, not the whole world) must keep launch.timeout_s, or a stopped peer holds the
    others for half an hour."""
    gave_up = multiprocessing.get_context("fork").Event()  # rank 0 -> rank 1
    results = run_ranks(_wait_in_a_subgroup, 4, (gave_up, 30.0), start_method="fork",
                        threads=1, backend="gloo", timeout_s=60, collective_timeout_s=2)
    for timeouts, _ in results:
        assert set(timeouts.values()) == {2.0}, timeouts
    assert results[0][1] is not None and results[0][1] < 4, results[0]  # rank 0 gave up in time
    assert results[2][1] is None and results[3][1] is None  # their group [2, 3] was complete
