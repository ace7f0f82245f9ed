"""The step-time model (lctrain.planning.timing, docs/parallelism.md §15) against hand-computed
values: compute, recompute (checkpointing, tiling), latency per collective call, fixed costs
per layout feature, data-parallel bytes where lctrain logs none, group placement on nodes, the
ring overlap bounds, the bubble; and a calibration round-trip through the file
`lctrain plan --calibrate` writes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lctrain.commands.calibrate import calibrate
from lctrain.config.validation import validate
from lctrain.layout.topology import Topology
from lctrain.planning.hardware import Hardware, hardware_for
from lctrain.planning.state import local_params
from lctrain.planning.timing import (
    StepShape,
    calibrated_layout,
    collective_calls,
    cp_group_bytes,
    dp_bytes,
    group_bandwidth_gbps,
    predict_step_time,
)
from lctrain.planning.traffic import cp_step_bytes, step_traffic_bytes
from tests.helpers import tiny_config

# tiny_config's model: D 64, 4 heads of 16 (2 KV), ffn 96, 2 blocks, vocab 128; S 32, 4 sequences
BLOCK = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 96 + 2 * 64  # 30,848 weights
PARAMS = 2 * BLOCK + 128 * 64 + 64 + 128 * 64  # 78,144: blocks, embedding, final norm, output
ATTENTION_PER_TOKEN = 3 * 2 * 32 * 64 * 2  # 3 x (QK^T + PV over S/2 keys) x 2 blocks: 24,576
FLOPS_PER_TOKEN = 3 * (2 * 2 * BLOCK + 2 * 64 * 128 + 5 * 128) + ATTENTION_PER_TOKEN + 3 * 64
TOKENS = 4 * 32


def hardware(**kw) -> Hardware:
    base = dict(device_tflops=1e-3, matmul_efficiency=1.0, attention_efficiency=1.0,
                intra_node_gbps=1.0, inter_node_gbps=0.1, ranks_per_node=0)
    return Hardware(**{**base, **kw})


def test_only_dp_communicates_time_is_flops_over_rate_plus_bytes_over_bandwidth():
    cfg = tiny_config(parallel={"dp": 2, "dp_engine": "ddp"})
    assert FLOPS_PER_TOKEN == 446_016
    t = predict_step_time(cfg, 2, hardware())
    compute = FLOPS_PER_TOKEN * TOKENS / 2 / 1e9  # each rank: half the step at 1 GFLOP/s
    dp = 2 * (1 / 2) * PARAMS * 4 / 1e9  # DDP: all-reduce of fp32 gradients at 1 GB/s
    assert t.comm_s == {"dp": pytest.approx(dp)}
    assert t.compute_s == pytest.approx(0.028545024)
    assert t.total_s == pytest.approx(compute + dp) == pytest.approx(0.0288576)
    assert t.exposed_comm_s == pytest.approx(dp) and t.bubble_s == 0
    assert t.tokens_per_s_per_rank == pytest.approx(TOKENS / t.total_s / 2)
    assert t.mfu == pytest.approx(compute / t.total_s)


def test_each_kernel_class_runs_at_its_efficiency():
    cfg = tiny_config()
    t = predict_step_time(cfg, 1, hardware(matmul_efficiency=0.5, attention_efficiency=0.25))
    matmul = (FLOPS_PER_TOKEN - ATTENTION_PER_TOKEN) * TOKENS / 1e9
    attention = ATTENTION_PER_TOKEN * TOKENS / 1e9
    assert t.comm_s == {}
    assert t.total_s == pytest.approx(matmul / 0.5 + attention / 0.25)
    assert t.mfu == pytest.approx((matmul + attention) / t.total_s)


def test_more_ranks_than_cores_share_the_calibrated_rate():
    cfg = tiny_config(parallel={"dp": 4, "dp_engine": "ddp"})
    costs = {"single": (1.0, 2.0), "base": (3.0, 4.0)}
    alone, shared = (predict_step_time(cfg, 4, hardware(cores=c, fixed_costs=costs))
                     for c in (0, 2))
    # compute, communication and fixed costs alike: all of it is CPU work on a shared core
    assert shared.compute_s == pytest.approx(2 * alone.compute_s)
    assert shared.comm_s["dp"] == pytest.approx(2 * alone.comm_s["dp"])
    assert shared.overhead_s == pytest.approx(2 * alone.overhead_s) == pytest.approx(2 * 10.0)
    assert shared.total_s == pytest.approx(2 * alone.total_s)


def test_a_group_is_intra_node_only_when_all_its_ranks_share_a_node():
    cfg = tiny_config(parallel={"tp": 2, "dp": 2, "dp_engine": "ddp"})
    topo = Topology.from_config(cfg, 4)  # tp groups {0, 1}, {2, 3}; dp_cp groups {0, 2}, {1, 3}
    two = hardware(ranks_per_node=2)
    assert group_bandwidth_gbps(topo, "tp", two) == 1.0
    assert group_bandwidth_gbps(topo, "dp_cp", two) == 0.1
    assert group_bandwidth_gbps(topo, "tp", hardware(ranks_per_node=1)) == 0.1
    assert group_bandwidth_gbps(topo, "dp_cp", hardware(ranks_per_node=4)) == 1.0

    nbytes = step_traffic_bytes(cfg, 4)
    split, one_node = predict_step_time(cfg, 4, two), predict_step_time(cfg, 4, hardware())
    assert split.comm_s["tp"] == pytest.approx(nbytes["tp"] / 1e9)
    assert split.comm_s["dp"] == pytest.approx(nbytes["dp"] / 1e8)  # across nodes: 0.1 GB/s
    assert one_node.comm_s["dp"] == pytest.approx(nbytes["dp"] / 1e9)
    assert split.total_s - one_node.total_s == pytest.approx(9 * nbytes["dp"] / 1e9)


def _attention_s(cfg, world, hw) -> float:
    return predict_step_time(cfg, world, hw).compute_s - predict_step_time(
        cfg, world, dataclasses.replace(hw, attention_efficiency=1e9)).compute_s


@pytest.mark.parametrize("gbps", [1e-4, 1e-2, 1e3])
def test_ring_p2p_hides_behind_all_but_one_block_of_attention(gbps):
    cfg = tiny_config(parallel={"cp": 4, "attention": "ring", "dp": 1})
    hw = hardware(intra_node_gbps=gbps)
    t = predict_step_time(cfg, 4, hw)
    ring = t.comm_s["cp_ring"]
    overlappable = _attention_s(cfg, 4, hw) * 3 / 4  # 3 transfers behind 3 of 4 blocks
    others = sum(t.comm_s.values()) - ring
    assert t.exposed_comm_s == pytest.approx(others + max(0.0, ring - overlappable))
    assert others <= t.exposed_comm_s <= sum(t.comm_s.values())
    if gbps == 1e3:
        assert t.exposed_comm_s == pytest.approx(others)  # the ring hidden entirely
    if gbps == 1e-4:
        assert t.exposed_comm_s > others


def test_ulysses_all_to_all_is_never_hidden_and_usp_splits_its_groups():
    ulysses = tiny_config(parallel={"cp": 2, "attention": "ulysses", "dp": 1})
    t = predict_step_time(ulysses, 2, hardware())
    assert "cp_ring" not in t.comm_s and t.comm_s["cp_ulysses"] > 0
    assert t.exposed_comm_s == pytest.approx(sum(t.comm_s.values()))
    usp = tiny_config(parallel={"cp": 4, "attention": "usp", "ulysses_degree": 2, "dp": 1})
    parts = cp_group_bytes(StepShape.of(usp, 4))
    assert set(parts) == {"cp_ring", "cp_ulysses"}
    assert sum(parts.values()) == pytest.approx(sum(cp_step_bytes(usp, 4).values()))
    # forward + backward elements x 2 blocks x 4 accumulation steps x 4 bytes
    ring_fwd = (2 - 1) * 2 * (32 / 2) * (2 * 16) / 2  # R=2, K and V of the KV heads' half
    assert parts["cp_ring"] == pytest.approx((ring_fwd + 2 * ring_fwd) * 2 * 4 * 4)


def test_the_bubble_stretches_a_pipelined_step_by_its_fraction():
    cfg = tiny_config(parallel={"pp": 2, "pp_schedule": "1f1b", "dp": 1})
    t = predict_step_time(cfg, 2, hardware(intra_node_gbps=1e12))
    fraction = (2 - 1) / (4 + 2 - 1)  # 4 micro-batches
    assert t.bubble_s / t.total_s == pytest.approx(fraction)
    assert t.total_s == pytest.approx((t.compute_s + t.exposed_comm_s) / (1 - fraction))


def test_checkpointing_and_tiling_add_the_forward_they_run_again():
    forward_block = 2 * BLOCK + 2 * 32 * 64  # matmuls + causal attention, per token
    attention_fwd = 2 * 32 * 64
    per_rank = TOKENS / 1e9  # tokens on the one rank at 1 GFLOP/s
    plain = predict_step_time(tiny_config(), 1, hardware())
    assert plain.recompute_s == 0
    full = predict_step_time(tiny_config(train={"activation_checkpointing": "full"}), 1,
                             hardware())
    assert full.recompute_s == pytest.approx(2 * forward_block * per_rank)
    assert full.compute_s == pytest.approx(plain.compute_s + full.recompute_s)
    # selective recomputes only elementwise work at cp = 1, the attention at cp > 1
    selective = {"activation_checkpointing": "selective"}
    assert predict_step_time(tiny_config(train=selective), 1, hardware()).recompute_s == 0
    cp2 = tiny_config(train=selective, parallel={"cp": 2, "dp": 1})
    assert predict_step_time(cp2, 2, hardware()).recompute_s == pytest.approx(
        2 * attention_fwd * per_rank / 2)
    tiled = tiny_config(train={"loss_chunk": 8, "mlp_chunk": 8})
    output_fwd, mlp_fwd = 2 * 64 * 128 + 5 * 128, 2 * 3 * 64 * 96
    assert predict_step_time(tiled, 1, hardware()).recompute_s == pytest.approx(
        (output_fwd + 2 * mlp_fwd) * per_rank)


def test_each_collective_call_pays_the_latency():
    cfg = tiny_config(parallel={"tp": 2, "sp": True, "dp": 1})  # 4 micro-steps of 2 blocks
    assert collective_calls(StepShape.of(cfg, 2)) == {"tp": 8 * 2 * 4}
    slow = predict_step_time(cfg, 2, hardware(latency_s=1e-3))
    assert slow.comm_s["tp"] - predict_step_time(cfg, 2, hardware()).comm_s["tp"] == \
        pytest.approx(64e-3)
    ring = tiny_config(parallel={"cp": 4, "attention": "ring", "dp": 1},
                       train={"activation_checkpointing": "full"})
    assert collective_calls(StepShape.of(ring, 4)) == {"cp_ring": 3 * 4 * 2 * 4}  # R-1 x (fwd, 2 bwd, again)
    pp = tiny_config(parallel={"pp": 2, "dp": 1})
    assert collective_calls(StepShape.of(pp, 2)) == {"pp": 4 * 1 * 4}


def test_fixed_costs_add_up_by_feature():
    costs = {"single": (1.0, 10.0), "base": (2.0, 20.0), "tp": (5.0, 30.0),
             "ring": (3.0, 25.0), "ulysses": (4.0, 20.0)}
    hw = hardware(device_tflops=1e9, intra_node_gbps=1e12, fixed_costs=costs)
    one = predict_step_time(tiny_config(), 1, hw)  # 2 blocks, 4 micro-steps
    assert one.overhead_s == pytest.approx((1.0 * 2 + 10.0) * 4)
    tp = predict_step_time(tiny_config(parallel={"tp": 2, "sp": True, "dp": 1}), 2, hw)
    assert tp.overhead_s == pytest.approx((5.0 * 2 + 30.0) * 4)
    # USP over a ring of 2 and Ulysses 2: base + the ring's extra x (R - 1) + Ulysses' extra
    usp = tiny_config(parallel={"cp": 4, "attention": "usp", "ulysses_degree": 2, "dp": 1})
    block, rest = 2.0 + 1.0 + 2.0, 20.0 + 5.0 + 0.0
    assert predict_step_time(usp, 4, hw).overhead_s == pytest.approx((block * 2 + rest) * 4)
    assert predict_step_time(tiny_config(), 1, hardware()).overhead_s == 0  # plan.*: none
    # DDP's extra is against base; a checkpointing mode's against single, on any engine
    costs |= {"ddp": (1.5, 12.0), "full": (4.0, 11.0)}
    hw = hardware(device_tflops=1e9, intra_node_gbps=1e12, fixed_costs=costs)
    ddp_full = tiny_config(parallel={"dp": 2, "dp_engine": "ddp"},
                           train={"activation_checkpointing": "full"})
    block, rest = 2.0 + (1.5 - 2.0) + (4.0 - 1.0), 20.0 + (12.0 - 20.0) + (11.0 - 10.0)
    assert predict_step_time(ddp_full, 2, hw).overhead_s == pytest.approx((block * 2 + rest) * 2)
    one_full = dataclasses.replace(ddp_full, parallel=dataclasses.replace(ddp_full.parallel,
                                                                          dp=1))
    assert predict_step_time(one_full, 1, hw).overhead_s == pytest.approx((4.0 * 2 + 11.0) * 4)


def test_data_parallel_bytes_where_lctrain_logs_none():
    # pipelining: FSDP gathers a stage's weights once per step, not once per micro-step
    pp = tiny_config(parallel={"pp": 2, "dp": 2})
    assert "dp" not in step_traffic_bytes(pp, 4)
    blocks, root = max((local_params(pp, r) for r in range(2)), key=lambda x: 2 * x[0] + x[1])
    gathered, reduced = (2 - 1) / 2 * (2 * blocks + root), (2 - 1) / 2 * (blocks + root)
    assert dp_bytes(StepShape.of(pp, 4)) == pytest.approx(4 * (gathered + reduced))
    # DeepSpeed: ZeRO-1/2 move DDP's all-reduce volume, ZeRO-3 FSDP's gathers too
    zero = {s: tiny_config(parallel={"dp": 2, "dp_engine": "deepspeed"},
                           deepspeed={"zero_stage": s}) for s in (2, 3)}
    ddp = tiny_config(parallel={"dp": 2, "dp_engine": "ddp"})
    fsdp = tiny_config(parallel={"dp": 2})
    assert dp_bytes(StepShape.of(zero[2], 2)) == step_traffic_bytes(ddp, 2)["dp"]
    assert dp_bytes(StepShape.of(zero[3], 2)) == step_traffic_bytes(fsdp, 2)["dp"]


@pytest.mark.slow  # 4 s: it measures this CPU
def test_calibration_round_trip(tmp_path):
    path = tmp_path / "cache" / "lctrain" / "calibration.json"
    model = tiny_config().model
    written = calibrate(path, model, 32, (calibrated_layout("base"),), nbytes=1 << 16, repeats=2)
    assert json.loads(path.read_text()) == written
    assert written["matmul_tflops"] > 0 and written["gloo_gbps"] > 0 and written["cores"] >= 1
    assert written["latency_s"] > 0 and set(written["fixed_costs"]) == {"base"}
    assert written["fixed_costs_for"] == {"model": dataclasses.asdict(model), "seq_len": 32}
    cfg = tiny_config(plan={"calibration": str(path)}, train={"device": "cpu"})
    hw = hardware_for(cfg, gpu_available=True)
    assert written["host_adam_gparams_per_s"] > 0
    assert (hw.device_tflops, hw.intra_node_gbps, hw.inter_node_gbps, hw.latency_s,
            hw.fixed_costs, hw.host_adam_gparams_per_s, hw.pcie_gbps, hw.source) == (
        written["matmul_tflops"], written["gloo_gbps"], written["gloo_gbps"],
        written["latency_s"], {"base": tuple(written["fixed_costs"]["base"])},
        written["host_adam_gparams_per_s"], 0.0, str(path))
    auto = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="auto"))
    assert hardware_for(auto, gpu_available=False) == hw
    assert hardware_for(auto, gpu_available=True).device_tflops == cfg.plan.device_tflops
    missing = tiny_config(plan={"calibration": str(tmp_path / "none.json")},
                          train={"device": "cpu"})
    assert hardware_for(missing, gpu_available=False).source == "plan.*"
    # the plan says whose rates its step uses
    from lctrain.commands.plan import whose_rates

    assert whose_rates(cfg, hw) == f"this CPU's, calibrated in {path}"
    assert whose_rates(missing, hardware_for(missing, gpu_available=False)) == (
        f"GPU figures from plan.* (989 TFLOP/s per GPU), not this CPU's: no calibration at "
        f"{tmp_path / 'none.json'}; `lctrain plan --calibrate` measures this machine")


def test_a_zero_rate_or_bandwidth_is_refused_naming_the_key():
    cfg = tiny_config(plan={"matmul_efficiency": 0.0, "inter_node_gbps": -1.0})
    problems = validate(cfg, 1)
    assert any(p.startswith("plan.matmul_efficiency=0.0") and "plan.matmul_efficiency=0.6" in p
               for p in problems), problems
    assert any(p.startswith("plan.inter_node_gbps=-1.0") for p in problems), problems


def test_a_cpu_machine_gets_one_note_it_can_act_on(monkeypatch):
    """Planning the tiny recipe on a machine without a GPU: one note (the run goes to the
    CPU; how to plan that), not a Slurm mismatch and a GPU-rates aside."""
    from lctrain.commands import plan as plan_command

    monkeypatch.setattr(plan_command.device.Accelerator, "count", lambda self: 0)
    cfg = tiny_config(parallel={"cp": 2, "dp": 2})
    (note,) = plan_command.world_note(cfg, 4)
    assert note.startswith("this machine has no GPU: `lctrain train` runs these 4 ranks on its "
                           "CPU") and "lctrain plan --calibrate" in note
    gpus = tiny_config(parallel={"cp": 2, "dp": 2}, train={"device": "cuda"})
    assert "would not match it" in plan_command.world_note(gpus, 4)[0]
