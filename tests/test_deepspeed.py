"""The DeepSpeed engine gives the numbers of the other engines: ZeRO 1, 2, 3 and 3 with the
optimizer and weights on the host, at dp2 and at dp2 x cp2 (ring, zigzag, packed documents),
train 3 steps with the losses and grad norms of the FSDP engine over the same batches. Bad
DeepSpeed settings are exit-2 configuration errors."""

import dataclasses

import pytest

from lctrain.parallel import deepspeed_engine
from lctrain.prepare.checks import preflight
from lctrain.training.loop import train
from tests.helpers import on_ranks, run_cli, tiny_config

pytest.importorskip("deepspeed")

ZERO = [  # (name, deepspeed section)
    ("zero1", {"zero_stage": 1}),
    ("zero2", {"zero_stage": 2}),
    ("zero3", {"zero_stage": 3}),
    ("zero3_offload", {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
]


def _cfg(parallel: dict, deepspeed: dict | None = None, data: dict | None = None):
    engine = {"dp_engine": "deepspeed"} if deepspeed is not None else {}
    # lr 1e-3: the engines agree to fp32 rounding on the first step; Adam's early updates,
    # about lr x sign(g), turn rounding-level gradient differences into 1e-4-level loss
    # differences by the third step at 3e-3
    return tiny_config(train={"steps": 3, "global_batch": 4, "micro_batch": 1},
                       parallel={**parallel, **engine}, deepspeed=deepspeed or {},
                       data=data or {}, optim={"lr": 1e-3, "warmup_steps": 1})


def _same(got, want, what):
    assert [h["step"] for h in got] == [1, 2, 3], what
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "lr"):
            assert g[key] == pytest.approx(w[key], rel=1e-4), (what, key, g[key], w[key])
        assert not g["skipped"]


@pytest.mark.slow
def test_zero_stages_match_fsdp(tmp_path):
    layout = {"dp": 2}
    ref = on_ranks(train, 2, _cfg(layout), str(tmp_path / "fsdp"))[0]
    for name, zero in ZERO:
        for history in on_ranks(train, 2, _cfg(layout, zero), str(tmp_path / name)):
            _same(history, ref, name)


@pytest.mark.slow
def test_zero3_offload_on_one_rank_matches_one_process(tmp_path):
    """At world 1 the engine still runs (a group of one): ZeRO-3 with the optimizer and the
    weights on the host trains like the plain one-process model, and checkpoints its own
    files."""
    ref = on_ranks(train, 1, _cfg({"dp": 1}), str(tmp_path / "plain"))[0]
    zero = dict(ZERO)["zero3_offload"]
    cfg = dataclasses.replace(_cfg({"dp": 1}, zero), checkpoint=dataclasses.replace(
        tiny_config().checkpoint, every=3))
    _same(on_ranks(train, 1, cfg, str(tmp_path / "zero3"))[0], ref, "zero3 offload, 1 rank")
    assert (tmp_path / "zero3" / "checkpoints" / "step-00000003" / "deepspeed").is_dir()


@pytest.mark.slow
def test_zero3_with_context_parallel_and_documents_matches_fsdp(tmp_path):
    layout = {"dp": 2, "cp": 2, "attention": "ring", "load_balance": "zigzag"}
    data = {"document_masking": True}
    ref = on_ranks(train, 4, _cfg(layout, data=data), str(tmp_path / "fsdp"))[0]
    for history in on_ranks(train, 4, _cfg(layout, {"zero_stage": 3}, data),
                            str(tmp_path / "zero3")):
        _same(history, ref, "zero3 dp2 x cp2")


BAD = {  # deepspeed overrides -> substrings of the message
    "unknown_key": (["+deepspeed.config.zero_optimisation.stage=2"],
                    ["deepspeed.config.zero_optimisation is not a DeepSpeed config key"]),
    "nested_key": (["+deepspeed.config.zero_optimization.reduce_bucket_sise=5e7"],
                   ["deepspeed.config is not accepted by DeepSpeed", "reduce_bucket_sise"]),
    "batch": (["+deepspeed.config.train_micro_batch_size_per_gpu=4"],
              ["deepspeed.config.train_micro_batch_size_per_gpu=4 contradicts lctrain's 2",
               "train.micro_batch"]),
    "optimizer": (["+deepspeed.config.optimizer.type=Adam"],
                  ["deepspeed.config.optimizer.type='Adam': lctrain sets the optimizer"]),
    "offload_param": (["deepspeed.zero_stage=2", "deepspeed.offload_param=cpu"],
                      ["deepspeed.offload_param=cpu offloads ZeRO-3's partitioned weights"]),
    "tp": (["parallel.tp=2", "parallel.dp=1"],
           ["parallel.dp_engine=deepspeed with parallel.tp=2", "set parallel.dp_engine=fsdp"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_deepspeed_settings_exit_2(name, capsys, tmp_path, monkeypatch):
    overrides, expected = BAD[name]
    monkeypatch.setattr("lctrain.training.loop.train", _refuse)
    code, _, err = run_cli(["train", "+recipe=tiny", "parallel.cp=1", "parallel.dp=2",
                            "launch.nproc=2", "parallel.dp_engine=deepspeed", *overrides,
                            f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 2
    for text in expected:
        assert text in err, err


def _refuse(*args, **kwargs):
    raise AssertionError("a run started for an invalid config")


def test_deepspeed_missing_is_a_configuration_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(deepspeed_engine.importlib.util, "find_spec",
                        lambda name: None if name == "deepspeed" else object())
    monkeypatch.setattr("lctrain.training.loop.train", _refuse)
    code, _, err = run_cli(["train", "+recipe=tiny", "parallel.dp_engine=deepspeed",
                            f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 2
    assert "deepspeed is not installed" in err and 'pip install -e ".[deepspeed]"' in err, err
    cfg = _cfg({"dp": 2})  # the other engines do not need it
    assert preflight(cfg, 2) == []


def _ckpt(deepspeed, steps, checkpoint, parallel=None):
    cfg = _cfg(parallel or {"dp": 2}, deepspeed)
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, **checkpoint))


@pytest.mark.slow
def test_resume_is_bit_exact_and_weights_move_between_engines(tmp_path):
    from lctrain.training import checkpoint as ck

    zero3 = {"zero_stage": 3}
    ref = on_ranks(train, 2, _ckpt(zero3, 4, {"every": 2}), str(tmp_path / "ref"))[0]
    run = tmp_path / "run"
    on_ranks(train, 2, _ckpt(zero3, 2, {"every": 2}), str(run))
    assert (run / "checkpoints" / "step-00000002" / "deepspeed").is_dir()
    assert not ck.damaged_files(run / "checkpoints" / "step-00000002")
    got = on_ranks(train, 2, _ckpt(zero3, 4, {"every": 0, "resume": "auto"}), str(run))[0]
    assert [(h["step"], h["loss"], h["grad_norm"]) for h in got] == [
        (h["step"], h["loss"], h["grad_norm"]) for h in ref[2:]]  # bit for bit
    # weights only, a fresh optimizer, from the start of the data: every engine that loads the
    # same weights takes the same first step
    deepspeed_step = tmp_path / "ref" / "checkpoints" / "step-00000002"
    fsdp_run = tmp_path / "fsdp"
    on_ranks(train, 2, _ckpt(None, 2, {"every": 2}), str(fsdp_run))
    fsdp_step = fsdp_run / "checkpoints" / "step-00000002"
    for saved in (deepspeed_step, fsdp_step):
        firsts = []
        for name, engine in [("fsdp", None), ("zero1", {"zero_stage": 1}), ("zero3", zero3)]:
            cfg = _ckpt(engine, 1, {"every": 0, "load": str(saved), "load_model_only": True})
            firsts.append(on_ranks(train, 2, cfg, str(tmp_path / f"{saved.parent.parent.name}"
                                                  f"_{name}"))[0][0])
        for first in firsts[1:]:
            for key in ("loss", "grad_norm"):
                assert first[key] == pytest.approx(firsts[0][key], rel=1e-5), (saved, key)
    # a DeepSpeed checkpoint cannot resume another engine's optimizer: a clear error
    with pytest.raises(Exception, match="was saved by the deepspeed engine"):
        on_ranks(train, 2, _ckpt(None, 3, {"every": 0, "load": str(deepspeed_step)}),
                 str(tmp_path / "mismatch"))


@pytest.mark.slow
def test_export_a_deepspeed_checkpoint_for_transformers(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from lctrain.models.registry import new_model

    cfg = _ckpt({"zero_stage": 3}, 2, {"every": 2})
    on_ranks(train, 2, cfg, str(tmp_path / "run"))
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "tools/export_hf.py", str(step), str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300, cwd=repo)
    assert done.returncode == 0, done.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    model = new_model(cfg.model)
    model.load_state_dict(deepspeed_engine.full_weights(step))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-5)
