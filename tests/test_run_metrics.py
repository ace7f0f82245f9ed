"""Run metrics (docs/parallelism.md §14): the model FLOPs of MFU against a FLOP counter, the
datasheet peaks, the keys a logged step gets on a cp2 x dp2 layout (peak memory as the max over
ranks, traffic equal to the planning formulas and to what the collectives sent, TensorBoard
events), TP and pipeline traffic formulas against counted sends, the W&B run continued after a
restart, and metrics.jsonl holding each step once after a resume."""

import json
import math
import shutil

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lctrain.config import derive
from lctrain.config.validation import validate
from lctrain.data.batch import IGNORE_INDEX
from lctrain.models.registry import new_model
from lctrain.planning.flops import datasheet_peak_tflops, mfu, train_flops_per_step
from lctrain.planning.state import local_params
from lctrain.planning.traffic import attention_traffic, dp_step_bytes
from lctrain.training.metrics import PeakMemory, measure_matmul_tflops
from tests.helpers import on_ranks, run_cli, tiny_config


def _dense_causal(q, k, v, doc_ids=None, window=None):
    """Causal attention as plain matmuls over every key (masked ones included): [B, S, H, d]
    (a model without window layers: `window` is None)."""
    assert window is None
    rep = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k.repeat_interleave(rep, 2),
                                            v.repeat_interleave(rep, 2)))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # [B, H, S, S]
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
    return (scores.masked_fill(mask, -math.inf).softmax(-1) @ v).transpose(1, 2)


def test_model_flops_match_a_flop_counter_and_peaks_come_from_the_table():
    cfg = tiny_config()
    m, S, B = cfg.model, cfg.train.seq_len, 3
    model = new_model(m, _dense_causal)
    model.init_weights(0)
    tokens = torch.randint(1, m.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=labels).backward()
    counted = counter.get_total_flops()
    # The counter sees matmuls only (forward, and backward at twice the forward), and the
    # attention over every key: QK^T and PV cost 4 S D per token and layer, where the causal
    # convention of docs/parallelism.md §14 counts the S/2 keys a query sees on average, 2 S D.
    # What the formula adds beyond the matmuls: the norm weights (2 per block of D), the
    # softmax (5 V) and the embedding lookup (D), 3x for forward + backward.
    T, D, L = B * S, m.dim, m.n_layers
    causal_half = 3 * T * 2 * S * D * L
    non_matmul = 3 * T * (2 * 2 * D * L + 5 * m.vocab_size + D)
    assert train_flops_per_step(cfg, T) == counted - causal_half + non_matmul
    # the same count from the shapes by hand: weights of wq, wk, wv, wo, w1, w2, w3 and output
    d_head, kv = D // m.n_heads, m.n_kv_heads * (D // m.n_heads)
    weights = L * (D * D + 2 * D * kv + D * D + 3 * D * m.ffn_dim) + D * m.vocab_size
    assert d_head * m.n_heads == D
    assert counted == 3 * T * (2 * weights + 4 * S * D * L)

    assert datasheet_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989
    assert datasheet_peak_tflops("NVIDIA H200", "tf32") == 495
    assert datasheet_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756
    assert datasheet_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312
    assert datasheet_peak_tflops("NVIDIA A100 80GB PCIe", "fp32") == 19.5
    assert datasheet_peak_tflops("NVIDIA B200", "bf16") == 2250
    assert datasheet_peak_tflops("NVIDIA GB200", "bf16") == 2500
    assert datasheet_peak_tflops("Tesla T4", "bf16") is None  # never a guess
    assert mfu(1e12, 2.0, 4, None) is None
    assert mfu(8e12, 2.0, 4, 1.0) == 1.0

    assert 0 < measure_matmul_tflops() < 100
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    before = memory.read()
    big = torch.ones(32 * 2**20)  # 128 MiB, every page touched
    del big
    assert memory.read() >= before + 120 * 2**20
    memory.reset()
    assert memory.per_step and memory.read() < before + 64 * 2**20  # the peak starts again


def test_logging_settings_are_configuration_errors(monkeypatch, capsys, tmp_path):
    assert any("logging.peak_tflops=0.0 must be > 0" in p
               for p in validate(tiny_config(logging={"peak_tflops": 0.0}), 1))
    assert validate(tiny_config(logging={"tensorboard": True, "peak_tflops": 989.0}), 1) == []
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    monkeypatch.setattr("lctrain.training.loop.train", _refuse)
    code, _, err = run_cli(["train", "+recipe=tiny", "logging.tensorboard=true",
                            f"hydra.run.dir={tmp_path}"], capsys)
    assert code == 2
    assert "logging.tensorboard=true but tensorboard is not installed" in err, err
    assert "pip install 'lctrain[tensorboard]'" in err, err


def _refuse(*args, **kwargs):
    raise AssertionError("a run started for an invalid config")


BIG = 512 * 2**20


def _train_allocating(cfg, run_dir):
    """train(); rank 3 holds BIG more bytes for a moment in its second step."""
    import torch.distributed as dist

    import lctrain.training.loop as T

    real, calls = T.train_step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if dist.get_rank() == 3 and calls[0] == 2:
            big = torch.ones(BIG // 4)
            del big
        return real(*args, **kwargs)

    T.train_step = step
    return T.train(cfg, run_dir)


def test_logged_keys_on_cp2_dp2(tmp_path):
    cfg = tiny_config(parallel={"cp": 2, "dp": 2, "attention": "ring"},
                      train={"micro_batch": 1, "global_batch": 4, "steps": 2},
                      logging={"tensorboard": True})
    run = tmp_path / "run"
    histories = on_ranks(_train_allocating, 4, cfg, str(run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    d, m = derive(cfg, 4), cfg.model
    # measured cp traffic equals the ring formula: forward + backward, per layer and micro-batch
    ring = attention_traffic("ring", cfg.train.seq_len, m.dim, m.n_kv_heads * m.dim // m.n_heads,
                             2, 1)
    cp_bytes = 4 * (ring["forward"] + ring["backward"]) * m.n_layers * d.grad_accum
    dp_bytes = dp_step_bytes("fsdp", *local_params(cfg), 4, d.grad_accum, 4)
    for r in rows:
        assert r["traffic/cp"] == r["cp_bytes_sent"] == cp_bytes
        assert r["traffic/dp"] == dp_bytes  # FSDP over dp x cp
        assert "traffic/tp" not in r and "traffic/pp" not in r  # groups of one rank
        flops = train_flops_per_step(cfg, d.tokens_per_step)
        assert r["tflops_per_rank"] == pytest.approx(flops / (r["step_time"] * 4) / 1e12)
        assert 0 < r["mfu"] < 1  # against the matmul rate measured on this CPU
        assert r["peak_mem_bytes"] > 0
    assert rows[0]["mfu"] / rows[0]["tflops_per_rank"] == pytest.approx(
        rows[1]["mfu"] / rows[1]["tflops_per_rank"])  # one peak for the run
    # the max over ranks: only rank 3 held BIG more, and only in step 2; every rank agrees
    assert rows[1]["peak_mem_bytes"] >= rows[0]["peak_mem_bytes"] + BIG / 2
    for h in histories:
        assert [x["peak_mem_bytes"] for x in h] == [r["peak_mem_bytes"] for r in rows]
        assert [x["data_time"] for x in h] == [r["data_time"] for r in rows]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {"loss", "mfu", "peak_mem_bytes", "traffic/cp", "traffic/dp"} <= set(
        events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]


def _train_counting_sends(cfg, run_dir):
    """train(); per step, the bytes this rank's DTensor collectives and pipeline sends sent."""
    from torch.distributed.pipelining import stage

    import lctrain.training.loop as T
    import lctrain.training.step as S
    from lctrain.comm import record_dtensor_traffic

    sent, per_step = {"tp": 0, "pp": 0}, []
    real_micro, real_step = S.micro_steps, T.train_step

    def micro(*args, **kwargs):
        with record_dtensor_traffic() as rec:
            out = real_micro(*args, **kwargs)
        sent["tp"] += sum(rec.bytes.values())
        return out

    def step(*args, **kwargs):
        sent.update(tp=0, pp=0)
        out = real_step(*args, **kwargs)
        per_step.append(dict(sent))
        return out

    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        real = getattr(stage._PipelineStageBase, name)

        def counted(self, *args, _real=real, **kwargs):
            ops = _real(self, *args, **kwargs)
            sent["pp"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops
        setattr(stage._PipelineStageBase, name, counted)
    S.micro_steps, T.train_step = micro, step
    return T.train(cfg, run_dir), per_step


@pytest.mark.parametrize("world,par,train", [
    # 2 blocks per pipeline rank; the embedding's collectives in fp32, the rest in bf16
    (4, {"pp": 2, "tp": 2, "sp": True}, {"dtype": "bf16"}),
    pytest.param(2, {"tp": 2}, {"activation_checkpointing": "full"},  # the recomputed forward
                 marks=pytest.mark.slow),  # sends again
    # two mixture-of-experts blocks (each rank routes its own shard: the attention's only)
    pytest.param(2, {"tp": 2, "sp": True}, {"activation_checkpointing": "full"},
                 marks=pytest.mark.slow),  # 2 s; the fast tier keeps the first case
], ids=["pp2_tp2_sp_bf16", "tp2_full_recompute", "tp2_sp_moe_full_recompute"])
def test_tp_and_pipeline_traffic_formulas_equal_what_was_sent(tmp_path, world, par, train):
    moe = {"family": "qwen3_moe", "n_experts": 4, "expert_ffn_dim": 48, "moe_layers": [0, 1]}
    cfg = tiny_config(model={"n_layers": 4, **(moe if par.get("sp") and world == 2 else {})},
                      parallel=par,
                      train={"micro_batch": 1, "global_batch": 4, "steps": 2, **train})
    results = on_ranks(_train_counting_sends, world, cfg, str(tmp_path), timeout_s=300)
    # unit: (t-1)/t x tokens x D = 1/2 x 32 x 64 elements; 4 micro-batches per step
    unit, accum = 32 * 64 // 2, 4
    if par.get("pp", 1) == 2:  # per block forward + backward 8 units; each end 2 units
        want_tp = {0: accum * unit * (2 * 2 * 8 + 4 * 2),  # 2 blocks and the embedding
                   1: accum * unit * (2 * 2 * 8 + 2 * 2)}  # 2 blocks and the output layer
        want_pp = 4 * accum * 16 * 64  # one [1, S/tp, D] fp32 tensor per micro-batch (SP)
    elif par.get("sp"):  # 2 dense blocks of 8 + 3 recomputed, 2 MoE blocks of 4 + 2, both ends
        want_tp, want_pp = {0: accum * unit * 4 * (2 * 11 + 2 * 6 + 2 * 2)}, None
    else:  # 4 blocks of 8 + 2 recomputed units, both ends, fp32
        want_tp, want_pp = {0: accum * unit * 4 * (4 * 10 + 2 * 2)}, None
    for rank, (history, per_step) in enumerate(results):
        pp_rank = rank // par["tp"] if par.get("pp", 1) == 2 else 0
        assert per_step[1]["tp"] == want_tp[pp_rank], (rank, per_step)  # step 1 infers shapes
        assert history[1]["traffic/tp"] == max(want_tp.values())  # the busiest pipeline rank
        if want_pp is not None:
            assert per_step[1]["pp"] == history[1]["traffic/pp"] == want_pp
        else:
            assert "traffic/pp" not in history[1]
        assert "traffic/dp" not in history[1] and "traffic/cp" not in history[1]


def _train(cfg, run_dir):
    from lctrain.training.loop import train

    return train(cfg, run_dir)


@pytest.mark.slow  # 4-6 s on 2 cores: two runs with W&B (offline) and TensorBoard
def test_a_resumed_run_logs_each_step_once_and_continues_its_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    cfg = tiny_config(train={"steps": 4}, checkpoint={"every": 2},
                      logging={"wandb": True, "wandb_mode": "offline", "tensorboard": True})
    first = on_ranks(_train, 1, cfg, str(run))[0]
    uninterrupted = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in uninterrupted] == [1, 2, 3, 4]
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # as if killed before that save
    resume = tiny_config(train={"steps": 4}, checkpoint={"every": 2, "resume": "auto"},
                         logging={"wandb": True, "wandb_mode": "offline", "tensorboard": True})
    second = on_ranks(_train, 1, resume, str(run))[0]
    assert [h["step"] for h in second] == [3, 4]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step once
    assert rows[:2] == uninterrupted[:2]
    assert [r["loss"] for r in rows[2:]] == [h["loss"] for h in second]  # the resumed run's
    assert [r["loss"] for r in rows[2:]] == [r["loss"] for r in uninterrupted[2:]]
    assert [r["loss"] for r in rows] == [h["loss"] for h in first]
    assert rows[2]["time"] > uninterrupted[3]["time"]  # written by the second run
    run_id = (run / "wandb_run_id").read_text().strip()
    folders = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.endswith("-" + run_id) for f in folders), folders
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()  # the second run's purge_step dropped the first run's steps 3 and 4
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
