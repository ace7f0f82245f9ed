"""A run stopped early (a signal, a STOP file, the time limit) says the exact command that
resumes it, `lctrain status` says it stopped, after which step and why, and that command, run as
printed, continues at the next step in the same run dir."""

from __future__ import annotations

import json
import shlex

from lctrain.training.preemption import PreemptionWatcher
from tests.helpers import run_cli

ONE_RANK = ["+recipe=tiny", "parallel.cp=1", "parallel.dp=1", "train.steps=4", "eval.every=0",
            "logging.log_every=1", "train.seq_len=64", "train.global_batch=2"]


def _steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
            .splitlines() if line.strip()]


def test_the_stop_names_the_command_that_resumes_it(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    asked = []

    def sigterm_after_step_2(self, rt):  # what SIGTERM makes the watcher answer
        asked.append(1)
        if len(asked) == 2:
            self.reason = "SIGTERM received"
        return len(asked) >= 2

    with monkeypatch.context() as patch:
        patch.setattr(PreemptionWatcher, "requested", sigterm_after_step_2)
        code, out, err = run_cli(["train", *ONE_RANK, f"hydra.run.dir={run_dir}"], capsys)
    assert code == 0 and _steps(run_dir) == [1, 2], err
    said = out + err
    hint = said.split("resume it with: ")[1].splitlines()[0]
    assert f"hydra.run.dir={run_dir.resolve()}" in hint and "checkpoint.resume=auto" in hint

    code, out, _ = run_cli(["status", str(run_dir)], capsys)
    assert code == 0 and "stopped" in out and "after step 2" in out, out
    assert "(SIGTERM received)" in out and "time left" not in out and hint in out, out

    words = shlex.split(hint)
    assert words[:2] == ["lctrain", "train"]
    code, out, err = run_cli(words[1:], capsys)  # as printed, from another directory
    assert code == 0 and _steps(run_dir) == [1, 2, 3, 4], out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "no second run dir"


def test_the_readme_eval_scores_the_tiny_run_beside_it(tmp_path, capsys, monkeypatch):
    """The tiny recipe keeps its last step's checkpoint, and `lctrain eval
    checkpoint.load=RUN_DIR/checkpoints/step-N` writes eval.json and its metrics row into that
    run dir, not a new one (the README's example, at 2 steps instead of 250)."""
    monkeypatch.chdir(tmp_path)  # a default run dir would land here
    run_dir = tmp_path / "run"
    code, _, err = run_cli(["train", *ONE_RANK, "train.steps=2", f"hydra.run.dir={run_dir}"],
                           capsys)
    assert code == 0, err
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    code, out, err = run_cli(["eval", *ONE_RANK, "eval.lengths=[64]",
                              f"checkpoint.load={checkpoint}"], capsys)
    assert code == 0, err
    scores = json.loads((run_dir / "eval.json").read_text())
    assert scores["step"] == 2 and "passkey" in json.dumps(scores["results"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "no second run dir"
    code, out, _ = run_cli(["status", str(run_dir)], capsys)
    assert code == 0 and "step         2 / 2" in out, out
