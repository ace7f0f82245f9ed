"""The plan's predictions (docs/parallelism.md §16): `predicted` holds, byte for byte, the
traffic keys `lctrain train` logs for the same layout (cp measured by `record_traffic`, the
other groups from the formulas), on layouts spanning tp with and without SP, every
context-parallel algorithm, pipelining, FSDP and DDP and activation checkpointing; and
`memory_per_rank` itemises one rank's memory, adds the stated allocator allowance and gives a
verdict that flips at plan.gpu_memory_gib."""

import json

import pytest

from lctrain.config import derive
from lctrain.config.validation import validate
from lctrain.planning.estimate import GIB, build_plan
from lctrain.planning.state import allocator_allowance, state_bytes_per_rank
from tests.helpers import on_ranks, run_cli, tiny_config, train_each

WORLD = 4
TRAFFIC_KEYS = ("cp_bytes_sent", "traffic/cp", "traffic/tp", "traffic/pp", "traffic/dp")


def _layout(parallel: dict, model: dict | None = None, **train):
    cfg = tiny_config(parallel=parallel, train={"micro_batch": 1, "steps": 2, **train},
                      logging={"log_every": 1}, model=model or {})
    assert validate(cfg, WORLD) == [], parallel
    return cfg


def _assert_logged_equals_predicted(tmp_path, layouts: dict) -> None:
    runs = [str(tmp_path / name) for name in layouts]
    on_ranks(train_each, WORLD, layouts, str(tmp_path), timeout_s=300)  # one spawn for all
    for (name, cfg), run in zip(layouts.items(), runs):
        predicted = build_plan(cfg, WORLD)["predicted"]
        want = {k: v for k, v in predicted.items() if k in TRAFFIC_KEYS}
        assert len(want) >= 3 and all(v > 0 for k, v in want.items() if k != "cp_bytes_sent")
        rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
        assert [r["step"] for r in rows] == [1, 2], name
        for row in rows:
            logged = {k: v for k, v in row.items() if k in TRAFFIC_KEYS}
            if row["step"] == 1 and cfg.parallel.pp > 1 and "traffic/cp" in want:
                # the pipeline's first step also runs one forward to learn the shapes
                first = sum(v for k, v in predicted["cp_collectives"].items()
                            if k.endswith("_fwd")) / derive(cfg, WORLD).grad_accum
                assert predicted["cp_first_step_extra"] == first, name
                logged["traffic/cp"] -= first
                logged["cp_bytes_sent"] -= first
            assert logged == want, (name, row["step"], logged, want)
        if "traffic/cp" in want:
            assert sum(predicted["cp_collectives"].values()) == want["cp_bytes_sent"]


@pytest.mark.slow  # 5 s on 2 cores (3 layouts on 4 ranks); the other 3 layouts stay fast
def test_predicted_traffic_equals_logged_tp_ring_ulysses(tmp_path):
    _assert_logged_equals_predicted(tmp_path, {
        # tp with SP, FSDP over dp, selective checkpointing (TP's recompute)
        "tp2_sp_dp2_selective": _layout({"tp": 2, "sp": True, "dp": 2},
                                        activation_checkpointing="selective"),
        # tp without SP and ring attention, FSDP over cp; selective checkpointing recomputes
        # the attention at cp > 1 (the ring's forward again) and TP's all-reduce after wo
        "tp2_cp2_ring_selective": _layout({"tp": 2, "cp": 2, "attention": "ring"},
                                          activation_checkpointing="selective"),
        # Ulysses, DDP over dp x cp
        "cp2_ulysses_dp2_ddp": _layout({"cp": 2, "attention": "ulysses", "dp": 2,
                                        "dp_engine": "ddp"}),
    })


@pytest.mark.slow  # 9 s (the fast tier keeps tests/test_run_metrics.py's traffic checks)
def test_predicted_traffic_equals_logged_usp_allgather_pipeline(tmp_path):
    _assert_logged_equals_predicted(tmp_path, {
        # USP (2 x 2): all-to-alls and ring, the attention recomputed (full), bf16
        "cp4_usp_full_bf16": _layout({"cp": 4, "attention": "usp", "ulysses_degree": 2},
                                     activation_checkpointing="full", dtype="bf16"),
        # all-gather KV, FSDP's bf16 policy over dp x cp
        "cp2_allgather_dp2_fsdp_bf16": _layout({"cp": 2, "attention": "allgather", "dp": 2},
                                               dtype="bf16"),
        # a pipeline of 2 with ring attention in each stage
        "pp2_cp2_ring": _layout({"pp": 2, "cp": 2, "attention": "ring"}),
        # Qwen3 (head norms) with H x d = 96 on D = 64: TP+SP and Ulysses move H x d wide
        # tensors, FSDP the replicated head norms too
        "qwen3_hd24_tp2_sp_cp2_ulysses": _layout(
            {"tp": 2, "sp": True, "cp": 2, "attention": "ulysses"},
            model={"family": "qwen3", "head_dim": 24}),
    })


def test_memory_is_itemised_and_the_verdict_flips_at_gpu_memory_gib(capsys):
    cfg = tiny_config(parallel={"cp": 2, "attention": "ring", "dp": 2})
    mem = build_plan(cfg, WORLD)["memory_per_rank"]
    items = mem["bytes"]
    state = items["weights"] + items["gradients"] + items["optimizer_state"]
    assert state == pytest.approx(state_bytes_per_rank(cfg, WORLD))
    assert items["attention_buffers"] > 0  # the ring's arriving block and fp32 accumulators
    modelled = sum(v for k, v in items.items()
                   if k not in ("modelled", "allocator_allowance", "total"))
    assert items["modelled"] == modelled
    assert items["allocator_allowance"] == allocator_allowance(modelled) == (
        0.1 * modelled + GIB)
    assert items["total"] == modelled + items["allocator_allowance"]
    assert mem["verdict"] == "FITS" and mem["gpu_memory_gib"] == 80.0
    assert mem["notes"][0].startswith("allocator_allowance = 10% of the modelled bytes + 1 GiB")
    total_gib = items["total"] / GIB
    for gib, verdict in ((total_gib * 1.001, "FITS"), (total_gib * 0.999, "DOES NOT FIT")):
        cfg.plan.gpu_memory_gib = gib
        assert build_plan(cfg, WORLD)["memory_per_rank"]["verdict"] == verdict, gib
    cfg.plan.gpu_memory_gib = 0.0
    assert any("plan.gpu_memory_gib=0.0 must be >= 0.1" in p for p in validate(cfg, WORLD))

    code, out, _ = run_cli(["plan", "+recipe=tiny", "plan.gpu_memory_gib=1.0"], capsys)
    assert code == 0
    assert "DOES NOT FIT in plan.gpu_memory_gib=1" in out, out
    assert "predicted per rank per step (bytes, as metrics.jsonl logs them):" in out
    assert "allocator_allowance" in out
    code, out, _ = run_cli(["plan", "+recipe=tiny", "--json", "plan.documents=[]"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert plan["memory_per_rank"]["verdict"] == "FITS"
    # the tiny recipe's ring (docs/parallelism.md §6, worked example), one document per
    # sequence (every token travels): 1,572,864 bytes per step
    assert plan["predicted"]["cp_bytes_sent"] == plan["predicted"]["traffic/cp"] == 1_572_864
    # with its passkey documents (plan.documents drawn from the source): the travelling share
    code, out, _ = run_cli(["plan", "+recipe=tiny", "--json"], capsys)
    share = json.loads(out)["packed_documents"]["documents"]["share"]
    assert 0 < share < 1
    assert json.loads(out)["predicted"]["cp_bytes_sent"] == pytest.approx(1_572_864 * share)
