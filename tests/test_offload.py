"""parallel.offload_state: state in host memory changes nothing but where it lives.

The reference of each layout is the same layout with every state on the device (itself checked
against one process elsewhere): losses, gradient norms and every whole gradient equal it, at
one rank, dp2, cp2 ring x dp2, tp2 + SP, Ulysses with tiling and activation offload,
all-gather KV under DDP and USP; a checkpoint saved offloaded resumes on the device
and back, the next steps equal an uninterrupted run; the host bytes the planner predicts equal
those the offloaded state holds, tensor by tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from lctrain.data.loader import build_loader
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.planning.state import host_state_parts
from lctrain.tracing.measure import measure_host_state
from lctrain.training.optim import build_optimizer, build_scheduler
from lctrain.training.step import train_step
from tests.helpers import on_ranks, run_cli, tiny_config, train_on_ranks, with_overrides

MODES = ("none", "optimizer", "optimizer+params")
TILED = {"loss_chunk": 8, "mlp_chunk": 8, "activation_checkpointing": "full",
         "offload_activations": True}
LAYOUTS = {  # name: (world, parallel.*, train.*)
    "one_rank": (1, {"dp": 1}, {"micro_batch": 2}),
    "dp2": (2, {"dp": 2}, {"micro_batch": 1}),
    "cp2_ring_dp2": (4, {"cp": 2, "dp": 2, "attention": "ring"}, {"micro_batch": 1}),
    "tp2_sp": (2, {"tp": 2, "sp": True, "dp": 1}, {"micro_batch": 2}),
    # the other cp algorithms, tiling and activation offload with it
    "cp2_ulysses_tiled": (2, {"cp": 2, "dp": 1, "attention": "ulysses"},
                          {"micro_batch": 2, **TILED}),
    "cp2_allgather_ddp": (2, {"cp": 2, "dp": 1, "attention": "allgather", "dp_engine": "ddp"},
                          {"micro_batch": 2}),
    "cp4_usp": (4, {"cp": 4, "dp": 1, "attention": "usp", "ulysses_degree": 2},
                {"micro_batch": 2}),
    # a mixture of experts split over the ranks (its experts DTensors on the ep mesh)
    "moe_ep2_dp2": (2, {"dp": 2, "ep": 2}, {"micro_batch": 1}),
}
MOE = {"family": "qwen3_moe", "n_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 48,
       "router_aux_loss_coef": 0.01}
"""The model of the layouts whose name starts with moe_."""


def _config(parallel: dict, train: dict, mode: str, model: dict | None = None):
    return tiny_config(parallel={**parallel, "offload_state": mode}, model=model or {},
                       train={"steps": 2, "global_batch": 4, **train})


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _steps(cfg, world: int) -> dict:
    """Two steps of `cfg` on this rank: every step's metrics, every whole gradient the
    optimizer was given, and the host bytes of the offloaded state after each step (before
    zero_grad: gradients kept)."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    optimizer = build_optimizer(model, cfg.optim, on_host=cfg.parallel.offload_state ==
                                "optimizer")
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
    grads, host = [], []

    optimizer.register_step_pre_hook(lambda *_: grads.append(
        {n: _whole(p.grad) for n, p in model.named_parameters()}))
    optimizer.register_step_post_hook(lambda opt, *_: host.append(
        measure_host_state(model, opt, cfg.parallel.offload_state)[0]))
    metrics = [train_step(model, optimizer, scheduler, loader.next_step(), cfg, rt)
               for _ in range(cfg.train.steps)]
    return {"metrics": metrics, "grads": grads, "host": host,
            "predicted_host": sum(host_state_parts(cfg, world).values())}


def _all_modes(layout: str) -> dict:
    """Every mode the layout's engine takes (DDP keeps its weights on the device)."""
    world, parallel, train = LAYOUTS[layout]
    modes = MODES[:2] if parallel.get("dp_engine") == "ddp" else MODES
    model = MOE if layout.startswith("moe_") else None
    return {mode: _steps(_config(parallel, train, mode, model), world) for mode in modes}


# in the fast tier one rank, data parallel, CP's all-gather with DDP; the MoE, 4-rank (ring
# with dp, USP), TP and tiled layouts (1 to 3 s each) in the full suite
@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=pytest.mark.slow)
    if name.startswith(("moe_", "cp4_", "tp2_", "cp2_ulysses", "cp2_ring")) else name
    for name in LAYOUTS])
def test_offloaded_state_equals_device_state(layout):
    world = LAYOUTS[layout][0]
    for rank, out in enumerate(on_ranks(_all_modes, world, layout)):
        ref = out["none"]
        for mode in list(out)[1:]:
            got = out[mode]
            # HostAdamW runs the device AdamW's arithmetic: bit for bit. FSDP's offload reduces
            # every micro-step's gradients (the reference: their sum once), so the sums round
            # differently: equal to float32 rounding
            rel = 0 if mode == "optimizer" else 1e-5
            for g, r in zip(got["metrics"], ref["metrics"]):
                assert g["loss"] == pytest.approx(r["loss"], rel=rel, abs=0), (mode, rank)
                assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=rel, abs=0)
            for g, r in zip(got["grads"], ref["grads"]):
                assert g.keys() == r.keys()
                for name in g:
                    torch.testing.assert_close(g[name], r[name], rtol=rel, atol=rel * 1e-2,
                                               msg=f"{mode} rank {rank} {name}")
            # the planner's host bytes are exactly what the offloaded state holds
            assert got["host"] == [got["predicted_host"]] * len(got["host"]), (mode, rank)


@pytest.mark.slow  # 7 s
def test_checkpoint_moves_between_offloaded_and_device_state(tmp_path):
    """A run checkpointed at step 2 with its state on the device resumes with it on the host
    (both modes, and resharded onto one rank), and one checkpointed offloaded resumes on the
    device: steps 3 and 4 equal the uninterrupted run's."""
    base = tiny_config(parallel={"dp": 2}, train={"steps": 4, "global_batch": 4,
                                                  "micro_batch": 1},
                       checkpoint={"every": 2, "keep": 0})
    modes = {mode: with_overrides(base, parallel={"offload_state": mode}) for mode in MODES}
    runs = {f"full_{m}": (2, cfg) for m, cfg in modes.items()}
    runs |= {f"half_{m}": (2, with_overrides(cfg, train={"steps": 2}))
             for m, cfg in modes.items()}
    moves = [("none", "optimizer+params"), ("none", "optimizer"), ("optimizer+params", "none"),
             ("optimizer", "optimizer+params")]
    for saved, loaded in moves:
        runs[f"{saved}_to_{loaded}"] = (2, with_overrides(
            modes[loaded], checkpoint={"load": str(tmp_path / f"half_{saved}" / "checkpoints"
                                                   / "step-00000002")}))
    # resharded too: the dp2 checkpoint on one rank, its state on the host
    runs["none_to_one_rank"] = (1, with_overrides(
        modes["optimizer+params"], parallel={"dp": 1},
        checkpoint={"load": str(tmp_path / "half_none" / "checkpoints" / "step-00000002")}))
    out = train_on_ranks(runs, str(tmp_path))
    moves.append(("none", "one_rank"))
    out["full_one_rank"] = out["full_none"]
    for saved, loaded in moves:
        resumed = out[f"{saved}_to_{loaded}"][0]
        full = out[f"full_{loaded}"][0]
        assert [h["step"] for h in resumed] == [3, 4]
        for got, ref in zip(resumed, full[2:]):  # float32 rounding: see the test above
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5), (saved, loaded, got)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.dp_engine=deepspeed", "parallel.offload_state=optimizer"],
     "DeepSpeed offloads through its own keys; set parallel.offload_state=none and "
     "deepspeed.offload_optimizer=cpu"),
    (["parallel.dp_engine=ddp", "parallel.offload_state=optimizer+params"],
     "only FSDP keeps its weights in host memory"),
    (["parallel.pp=2", "parallel.cp=1", "parallel.offload_state=optimizer+params"],
     "set parallel.offload_state=optimizer or parallel.pp=1"),
])
def test_offload_that_cannot_compose_is_exit_2(overrides, message, capsys):
    code, _, err = run_cli(["plan", "+recipe=tiny", *overrides], capsys)
    assert code == 2 and message in err, err


def test_plan_prints_the_host_side(capsys):
    code, out, _ = run_cli(["plan", "+recipe=tiny", "parallel.offload_state=optimizer+params"],
                           capsys)
    assert code == 0
    assert "host memory per rank" in out and "FITS in plan.host_memory_gib=2048 per node" in out
    assert "host<->device copies per step" in out
