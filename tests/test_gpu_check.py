"""tools/gpu_check.py: --dry-run runs every check's wiring on the CPU (tiny sizes; the torch
backend through its CPU implementation), and the runner survives what a first GPU run meets: a
check that raises is FAIL, a check that hangs is stopped at its own time limit, the JSON holds
every result as soon as it is known, and the budget stops checks that would not fit."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALL_CHECKS = {"env", "kernels", "cp_algorithms", "train_tiny", "selective_memory",
              "offload_and_tiling", "state_offload", "compile", "checkpoint_resume", "step_8b",
              "kernel_throughput", "batch_transfer", "moe_grouped_mm", "documents_windows_sinks",
              "families_step", "linear_rule"}


@pytest.mark.slow  # 22 s on 2 cores: every check's wiring, each in its own process
def test_gpu_session_dry_run(tmp_path):
    """tools/gpu_session.sh, the one command docs/gpu.md gives, with --dry-run: every check's
    wiring, then the debug-gpu recipe planned."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", "tools/gpu_session.sh", str(out), str(tmp_path / "no-wheels"),
                           "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "debug-gpu plan: exit 0" in done.stdout
    assert "torch 2." in (out / "env.txt").read_text()
    out = out / "gpu_check.json"
    report = json.loads(out.read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert set(statuses) == ALL_CHECKS
    assert set(statuses.values()) == {"PASS"}, statuses
    assert report["summary"]["FAIL"] == 0 and report["summary"]["dry_run"] is True
    kernels = next(c for c in report["checks"] if c["name"] == "kernels")
    assert {c["backend"] for c in kernels["cases"]} == {"torch", "reference", "cpu"}
    assert any(case["documents"] for case in kernels["cases"])  # the varlen path ran
    cp = next(c for c in report["checks"] if c["name"] == "cp_algorithms")
    assert {(c["algorithm"], c["ranks"]) for c in cp["cases"]} == {
        (a, w) for a in ("ring", "ulysses", "allgather") for w in (2, 4)} | {("usp", 4)}
    step = next(c for c in report["checks"] if c["name"] == "step_8b")
    assert step["plan_step_s"] > 0 and step["plan_modelled_gib"] > 0  # the plan beside it
    linear = next(c for c in report["checks"] if c["name"] == "linear_rule")
    assert [c["rule"] for c in linear["cases"]] == ["torch"]  # fla: on CUDA, where installed
    resume = next(c for c in report["checks"] if c["name"] == "checkpoint_resume")
    assert resume["resumed_steps"] == [3, 4]
    assert f"summary: {len(ALL_CHECKS)} passed, 0 failed, 0 skipped" in done.stdout
    assert (tmp_path / "lctrain-gpu-check" / "checkpoint_resume").is_dir()  # runs under TMPDIR


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _passes(ctx):
    return {"status": "PASS", "detail": "ok"}


def _raises(ctx):
    raise ValueError("a real failure, not a precondition")


def _hangs(ctx):
    threading.Event().wait()  # stopped by the check's time limit


def test_runner_fails_raising_and_hanging_checks_and_writes_after_each(tmp_path, monkeypatch):
    gc = _load_gpu_check()
    monkeypatch.setattr(gc, "CHECKS", {
        "first": gc.Check(_passes, 1, 30), "raises": gc.Check(_raises, 1, 30),
        "hangs": gc.Check(_hangs, 1, 1), "after": gc.Check(_passes, 1, 30),
        "too_long": gc.Check(_passes, 10_000, 20_000)})
    out = tmp_path / "gpu_check.json"
    written = []
    write = gc._write
    monkeypatch.setattr(gc, "_write", lambda path, results, summary: (
        written.append([r["name"] for r in results]), write(path, results, summary)))
    results = gc.run(gc.Context(dry_run=True, quick=True), tmp_path, out, budget_s=300)
    status = {r["name"]: (r["status"], r["detail"]) for r in results}
    assert status["first"][0] == "PASS" and status["after"][0] == "PASS"
    assert status["raises"][0] == "FAIL" and "ValueError: a real failure" in status["raises"][1]
    assert status["hangs"][0] == "FAIL" and "timeout" in status["hangs"][1]
    assert status["too_long"][0] == "SKIP" and "budget" in status["too_long"][1]
    assert written == [["first"], ["first", "raises"], ["first", "raises", "hangs"],
                       ["first", "raises", "hangs", "after"],
                       ["first", "raises", "hangs", "after", "too_long"]]
    report = json.loads(out.read_text())
    assert report["summary"] | {"seconds": 0} == {"PASS": 2, "FAIL": 2, "SKIP": 1, "seconds": 0,
                                                   "dry_run": True}
