"""bench/engines.py runs end to end at tiny sizes, and the states it measures are those of the
formulas where the engines keep no extra copies: DDP and FSDP exactly, ZeRO-1's full gradients
at the end of the backward, ZeRO-3 with offload nothing sharded on the device but its
persistent parameters, all of its state on the host. The table is read by its header names."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3_offload")


def column_names(groups_line: str, names_line: str) -> list[str]:
    """The table's two header lines -> one name per column, "group meas" style. A group name
    ("device total": words one space apart) is centred over its columns and each column name
    ("meas", "form", "plan", "ms") is right-aligned in its own, so a column belongs to the group
    whose centre is nearest its own. The first group reaches as far left of its centre as half
    the way to the next one: the columns left of that ("engine", "dp", "r") have no group."""
    def centre(m: re.Match) -> float:
        return (m.start() + m.end() - 1) / 2

    groups = [(centre(m), m.group()) for m in re.finditer(r"\S+(?: \S+)*", groups_line)]
    assert len(groups) >= 2, groups_line
    left_edge = groups[0][0] - (groups[1][0] - groups[0][0]) / 2
    names = []
    for m in re.finditer(r"\S+", names_line):
        if centre(m) < left_edge:
            names.append(m.group())
        else:
            group = min(groups, key=lambda g: abs(g[0] - centre(m)))[1]
            names.append(f"{group} {m.group()}")
    return names


def parse_table(stdout: str) -> dict[str, list[dict[str, float]]]:
    """engine -> its rows (one per rank) as {column name: value}."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["engine", "dp", "r"])
    names = column_names(lines[header - 1], lines[header])
    rows: dict[str, list[dict[str, float]]] = {}
    for line in lines[header + 1:]:
        cells = line.split()
        if not cells or cells[0] not in ENGINES:
            continue
        assert len(cells) == len(names), (names, line)
        row = dict(zip(names, cells))
        rows.setdefault(cells[0], []).append(
            {name: float(value.rstrip("*")) for name, value in row.items() if name != "engine"})
    return rows


def test_column_names_follow_the_header(capsys):
    from bench.engines import print_table_header

    print_table_header()
    groups_line, names_line = capsys.readouterr().out.strip("\n").splitlines()
    assert column_names(groups_line, names_line) == [
        "engine", "dp", "r", "weights meas", "weights form", "grads meas", "grads form",
        "optimizer meas", "optimizer form", "device total meas", "device total form",
        "device total plan", "host meas", "host form", "buffers meas", "step ms"]


@pytest.mark.slow  # 42 s on 2 cores: six engines (DeepSpeed among them) at dp=2, in a subprocess
def test_bench_runs_and_matches_the_formulas_where_it_should():
    cmd = [sys.executable, "bench/engines.py", "--dp", "2", "--dim", "64", "--vocab", "512",
           "--layers", "2", "--seq-len", "16", "--steps", "1", "--warmup", "1", "--no-details"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = parse_table(out.stdout)
    assert {name: len(r) for name, r in rows.items()} == dict.fromkeys(ENGINES, 2), out.stdout
    for name in ("ddp", "fsdp"):
        for row in rows[name]:
            for group in ("weights", "grads", "optimizer"):
                assert row[f"{group} meas"] == row[f"{group} form"], (group, row)
            assert row["device total meas"] == row["device total form"] == \
                row["device total plan"], row
    for row in rows["zero1"]:
        # full grads, sharded moments
        assert row["grads meas"] == row["grads form"], row
        assert row["optimizer meas"] == row["optimizer form"], row
        assert row["weights meas"] > row["weights form"], row  # + the fp32 master partition
    for row in rows["zero3_offload"]:
        assert row["optimizer meas"] == 0, row
        assert row["host meas"] >= row["host form"] > 0, row
