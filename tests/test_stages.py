"""Staged context extension in one run (train.stages): the same losses as the hand-chained runs
(each loading the checkpoint the one before ended with, its data continuing at the same
token), a resume in the middle of stage 2 continues bit for bit, and a schedule that does not
add up, or a stage whose layout is invalid, is refused naming the stage."""

import shutil

import pytest

from lctrain.config.schema import StageConfig
from lctrain.config.validation import validate
from lctrain.data.loader import DataLoader
from lctrain.data.synthetic import SyntheticLM
from tests.helpers import on_ranks, tiny_config, train_each, with_overrides

STAGES = [StageConfig(16, 2), StageConfig(32, 2), StageConfig(64, 2)]
CONSTANT_LR = {"lr": 1e-3, "min_lr": 1e-3, "warmup_steps": 1}  # chained runs differ in steps


def _staged(**checkpoint):
    return tiny_config(train={"seq_len": 64, "steps": 6, "global_batch": 2, "micro_batch": 1,
                              "stages": STAGES},
                       parallel={"dp": 2}, optim=CONSTANT_LR,
                       checkpoint={"every": 0, "keep": 0, **checkpoint})


def _chained(root: str) -> list:
    """The stages as three plain runs, each loading the previous one's last checkpoint."""
    runs, load = {}, None
    for i, (seq, batch, micro, steps) in enumerate([(16, 8, 4, 2), (32, 4, 2, 4),
                                                    (64, 2, 1, 6)]):
        cfg = tiny_config(train={"seq_len": seq, "steps": steps, "global_batch": batch,
                                 "micro_batch": micro}, parallel={"dp": 2}, optim=CONSTANT_LR,
                          checkpoint={"every": steps, "load": load})
        runs[f"chained{i}"] = cfg
        load = f"{root}/chained{i}/checkpoints/step-{steps:08d}"
    return runs


def test_a_staged_run_equals_the_hand_chained_runs(tmp_path):
    staged = _staged()
    assert validate(staged, 2) == []
    runs = {"staged": staged, **_chained(str(tmp_path))}
    histories = on_ranks(train_each, 2, runs, str(tmp_path), timeout_s=300)[0]
    chained = [h for i in range(3) for h in histories[f"chained{i}"]]
    assert [h["step"] for h in histories["staged"]] == [h["step"] for h in chained] == [
        1, 2, 3, 4, 5, 6]
    for got, want in zip(histories["staged"], chained):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"], got["step"]
        assert got["valid_tokens"] == want["valid_tokens"] == 128  # tokens per step held
    assert (tmp_path / "staged" / "checkpoints" / "step-00000004").is_dir()  # stages end saved


@pytest.mark.slow  # 4 s
def test_a_resume_in_the_middle_of_stage_2_continues_bit_for_bit(tmp_path):
    ref = on_ranks(train_each, 2, {"ref": _staged(every=1)}, str(tmp_path), timeout_s=300)[0]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ref", resumed)
    for step in (4, 5, 6):  # as a run stopped after step 3 (stage 2's first) leaves it
        shutil.rmtree(resumed / "checkpoints" / f"step-{step:08d}")
    again = on_ranks(train_each, 2, {"resumed": _staged(every=1, resume="auto")},
                     str(tmp_path), timeout_s=300)[0]["resumed"]
    assert [h["step"] for h in again] == [4, 5, 6]
    for got, want in zip(again, ref["ref"][3:]):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]


def test_the_data_continues_at_the_same_token():
    def loader(seq_len):
        return DataLoader(SyntheticLM(tiny_config().data, 128, seq_len, 0), seq_len, dp_rank=0,
                          dp=1, cp_rank=0, cp=1, load_balance="none", micro_batch=1,
                          grad_accum=1, document_masking=False, seed=0)

    state = {**loader(16).state_dict(), "consumed": 6}
    with pytest.raises(ValueError, match="seq_len: saved 16, now 32"):
        loader(32).load_state_dict(state)  # a plain resume never changes the length silently
    longer = loader(32)
    assert longer.load_state_dict(state, continue_data=True) == (
        "the data continues at token 96 (train.seq_len 16 -> 32)")
    assert longer.consumed == 3
    with pytest.raises(ValueError, match="seq_len"):
        loader(64).load_state_dict(state, continue_data=True)  # 96 tokens: not whole sequences


def test_a_bad_schedule_is_refused_naming_the_stage():
    cfg = with_overrides(_staged(), train={"steps": 5})
    assert "train.stages' steps add up to 6, but train.steps=5; set train.steps=6" in validate(
        cfg, 2)
    cfg = with_overrides(_staged(), train={"stages": [StageConfig(48, 3), StageConfig(64, 3)]})
    assert any(p.startswith("train.stages[0] (seq_len=48): train.global_batch=2 x "
                            "train.seq_len=64 tokens are not a whole number") for p in validate(
        cfg, 2))
    cfg = with_overrides(_staged(), parallel={"dp": 1, "cp": 2})  # 16 tokens: 4 zigzag chunks ok
    cfg = with_overrides(cfg, train={"stages": [StageConfig(2, 3), StageConfig(64, 3)],
                                     "global_batch": 1})
    assert any(p.startswith("train.stages[0] (seq_len=2): train.seq_len=2 must be a multiple of 4")
               for p in validate(cfg, 2))


def test_the_plan_reports_every_stage(capsys):
    import json

    from tests.helpers import run_cli

    code, out, err = run_cli(["plan", "+recipe=tiny", "train.stages=[{seq_len: 64, steps: 100}, "
                              "{seq_len: 128, steps: 100}, {seq_len: 256, steps: 50}]", "--json"],
                             capsys)
    assert code == 0, err
    plan = json.loads(out)
    rows = plan["stages"]
    assert [(r["seq_len"], r["global_batch"], r["micro_batch"], r["steps"]) for r in rows] == [
        (64, 32, 8, [1, 100]), (128, 16, 4, [101, 200]), (256, 8, 2, [201, 250])]
    assert rows[-1]["memory_gib"] == plan["memory_per_rank"]["total_gib"]  # the last stage's
    assert rows[-1]["step_s"] == plan["step_time"]["total_s"]
    assert all(r["verdict"] == "FITS" and r["stage_s"] > 0 for r in rows)


def test_each_stage_says_its_length_and_the_eval_lengths_it_skips():
    from lctrain.config.derived import context_stages, stage_banner

    cfg = with_overrides(_staged(), eval={"every": 2, "lengths": [16, 48, 64]})
    banners = [stage_banner(cfg, stage) for stage in context_stages(cfg)]
    assert banners[0] == [
        "lctrain: stage 1 of 3: steps 1-2 at train.seq_len=16, 8 sequences per step",
        "lctrain: eval.lengths 48, 64 skipped in stage 1: longer than its sequences of 16 "
        "tokens (scored from the stage that trains at that length on)"]
    assert banners[1][1].startswith("lctrain: eval.lengths 48, 64 skipped in stage 2")
    assert banners[2] == ["lctrain: stage 3 of 3: steps 5-6 at train.seq_len=64, 2 sequences "
                          "per step"]
    assert stage_banner(tiny_config(), context_stages(tiny_config())[0]) == []


@pytest.mark.slow  # 7 s on 2 cores: the README's demo with 2 + 2 steps, in this process
def test_the_readme_extends_a_context_as_written(tmp_path, monkeypatch, capsys):
    """README's "Extend a model's context" commands, run as written in a fresh folder, the
    steps cut from 40 + 40 to 2 + 2: two stages with a length mix, ending with the needle
    heatmap and the loss-by-position plot."""
    import runpy
    import shlex
    import sys
    from pathlib import Path

    from tests.helpers import run_cli

    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    section = readme[readme.index("## Extend a model's context"):]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start:section.index("\n```", start)]
    commands = [shlex.split(c, comments=True) for c in block.replace("\\\n", " ").splitlines()]
    assert [c[:2] for c in commands] == [["python", "tools/demo_corpus.py"],
                                         ["lctrain", "preprocess"], ["lctrain", "train"],
                                         ["lctrain", "plot"]]
    monkeypatch.chdir(tmp_path)
    for words in commands:
        words = [w.replace("steps: 40", "steps: 2").replace("train.steps=80", "train.steps=4")
                 .replace("eval.every=40", "eval.every=2") for w in words]
        if words[0] == "python":
            monkeypatch.setattr(sys, "argv", words[1:])
            runpy.run_path(str(repo / words[1]), run_name="__main__")
            continue
        assert words[0] == "lctrain"
        code, _, err = run_cli(words[1:], capsys)
        assert code == 0, (words, err[-3000:])
    plots = tmp_path / "demo" / "run" / "plots"
    assert (plots / "needle_heatmap.png").is_file() and (plots / "loss_by_position.png").is_file()
    import json

    rows = [json.loads(line) for line in (tmp_path / "demo" / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert "val_loss/pos128-256" in rows[-1] and "eval/needle/len256/depth0.50" in rows[-1]
