"""tools/gpu_check.py --dry-run: every check of the GPU script runs on the CPU (tiny sizes, the
plain-torch varlen kernel in place of flash-attn), so its wiring is tested before a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out),
                           "--run-dir", str(tmp_path / "runs")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert set(statuses) == {"env", "kernels", "cp_algorithms", "train_tiny", "selective_memory",
                             "offload_and_tiling", "wrapper_overhead", "step_8b",
                             "batch_transfer"}
    assert set(statuses.values()) == {"PASS"}, statuses
    assert report["summary"]["FAIL"] == 0 and report["summary"]["dry_run"] is True
    kernels = next(c for c in report["checks"] if c["name"] == "kernels")
    assert any(case["documents"] for case in kernels["cases"])  # the varlen path ran
    step = next(c for c in report["checks"] if c["name"] == "step_8b")
    assert step["plan_step_s"] > 0 and step["plan_modelled_gib"] > 0  # the plan beside it
    assert "summary: 9 passed, 0 failed, 0 skipped" in done.stdout
