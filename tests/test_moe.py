"""Mixtures of experts beyond the families' parity with transformers (tests/test_model_families):
the load-balancing loss against transformers' function, expert parallelism's all-to-all
traffic against the formula of docs/parallelism.md §28 for the routing that happened, the
plan's traffic at uniform routing, and the refusals."""

import pytest
import torch
import torch.distributed as dist

from lctrain.comm import record_traffic
from lctrain.config.validation import validate
from lctrain.data.batch import IGNORE_INDEX
from lctrain.data.loader import build_loader
from lctrain.models.moe import load_balancing_loss
from lctrain.parallel.experts import EP_TAG
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.planning.traffic import ep_step_bytes, expert_all_to_all_elements
from lctrain.training.step import Routing, micro_steps
from tests.helpers import on_ranks, tiny_config

MOE = {"family": "qwen3_moe", "n_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 48,
       "router_aux_loss_coef": 0.01}


def test_the_load_balancing_loss_is_transformers_over_every_layer():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(40, 6, generator=g) for _ in range(3)]
    probs = [torch.softmax(logits, dim=-1) for logits in layers]
    counts = sum(torch.bincount(torch.topk(p, 2).indices.flatten(), minlength=6) for p in probs)
    ours = load_balancing_loss(counts.float(), sum(p.sum(dim=0) for p in probs),
                               torch.tensor(120.0), 6)
    assert float(ours) == pytest.approx(float(load_balancing_loss_func(tuple(layers), 6, 2)),
                                        rel=1e-6)


def _ep_traffic(cfgs: dict) -> dict:
    """On this rank, per config: the elements its experts' all-to-alls sent in one step, and
    every rank's tokens per expert and MoE layer (gathered)."""
    out = {}
    for name, cfg in cfgs.items():
        rt = setup_distributed(cfg)
        model = build_model(cfg, rt)
        micro_batches = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum
                                     ).next_step()
        routing = Routing()
        tokens = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in micro_batches)
        with record_traffic() as traffic:
            micro_steps(model, micro_batches, 1.0 / tokens, rt, routing)
        counts = [torch.zeros_like(routing.counts) for _ in range(rt.world_size)]
        dist.all_gather(counts, routing.counts)
        out[name] = (traffic.total(tag=EP_TAG), torch.stack(counts))
    return out


def test_expert_parallel_traffic_is_the_formula_of_the_routing_that_happened():
    """ep2 over dp2: each rank sends its rows for the other rank's experts and the rows it
    computed for the other rank back, and both again in the backward (and once more in the
    recomputed forward under full checkpointing): 2 (s + q) D per MoE layer, s and q counted
    from every rank's router output. The plan's uniform-routing figure is the same formula."""
    cfgs = {mode: tiny_config(model=MOE, parallel={"dp": 2, "ep": 2},
                              train={"global_batch": 2, "micro_batch": 1,
                                     "activation_checkpointing": mode})
            for mode in ("none", "full")}
    for cfg in cfgs.values():
        assert validate(cfg, 2) == []
    per_rank = on_ranks(_ep_traffic, 2, cfgs)
    for mode, cfg in cfgs.items():
        for rank, result in enumerate(per_rank):
            sent, counts = result[mode]  # counts: [rank, MoE layer, expert]
            mine = slice(2 * rank, 2 * rank + 2)  # ep2 of 4 experts: 2 each
            others = [r for r in range(2) if r != rank]
            s = int(counts[rank].sum() - counts[rank][:, mine].sum())
            q = int(counts[others][:, :, mine].sum())
            forwards = 2 if mode == "full" else 1
            assert sent == expert_all_to_all_elements(s, q, cfg.model.dim, forwards), mode
    rows = 32 * 2 // 2  # a micro-batch's 32 tokens x k rows, half of them to the other rank
    # one micro-step, 2 MoE layers, fp32
    assert ep_step_bytes(cfgs["none"], 2) == 2 * expert_all_to_all_elements(rows, rows, 64) * 4


@pytest.mark.parametrize("model,parallel,message", [
    ({"n_experts": 4}, {}, "model.n_experts=4 with model.family=llama, whose MLPs are dense"),
    ({"family": "mixtral"}, {}, "model.family=mixtral is a mixture of experts: set "
                                "model.n_experts"),
    ({**MOE, "experts_per_token": 5}, {}, "model.experts_per_token=5 exceeds model.n_experts=4"),
    ({**MOE, "moe_layers": [0, 2]}, {}, "model.moe_layers=[0, 2] must name distinct layers 0..1"),
    ({}, {"ep": 2, "dp": 2}, "parallel.ep=2 splits a mixture of experts, but"),
    (MOE, {"ep": 3, "dp": 3}, "parallel.ep=3 does not divide model.n_experts=4"),
    (MOE, {"ep": 4, "dp": 2}, "parallel.ep=4 must divide dp x cp x tp = 2 x 1 x 1"),
    (MOE, {"tp": 2}, "parallel.tp=2 without parallel.sp with a mixture-of-experts model"),
])
def test_what_experts_cannot_do_is_refused_with_its_fix(model, parallel, message):
    cfg = tiny_config(model=model, parallel=parallel)
    world = parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("dp", 1)
    assert any(message in p for p in validate(cfg, world)), validate(cfg, world)


@pytest.mark.slow  # 2-4 s: the search forks workers
def test_the_search_finds_expert_parallel_layouts_for_qwen3_30b_a3b_at_128k():
    """The issue's plan: Qwen3-30B-A3B at 131,072 tokens on one node of 8 GPUs. The search
    tries every ep that divides dp x cp x tp and the 128 experts; the first ep layouts validate,
    and FSDP moves 1/ep of the experts' weights. (An ep layout no longer ranks first: its lead
    came from the plan's negative expert gradients under TP, tests/test_cuda_step.py.)"""
    from lctrain.config.compose import compose
    from lctrain.planning.hardware import hardware_from_plan
    from lctrain.planning.search import search
    from lctrain.planning.traffic import data_parallel_bytes

    cfg = compose(["model=qwen3-30b-a3b", "train.seq_len=131072", "slurm.nodes=1",
                   "slurm.gpus_per_node=8"]).cfg
    result = search(cfg, 8, hardware_from_plan(cfg))
    with_ep = [c for c in result.ranked if c.overrides.get("parallel.ep", 1) > 1]
    assert with_ep
    assert {c.overrides["parallel.ep"] for c in with_ep} <= {2, 4, 8}
    for candidate in with_ep[:3]:
        chosen = compose(["model=qwen3-30b-a3b", "train.seq_len=131072",
                          *candidate.command_line().split()]).cfg
        assert validate(chosen, 8) == [], candidate.command_line()
    ep8 = compose(["model=qwen3-30b-a3b", "train.seq_len=131072", "parallel.cp=8",
                   "parallel.dp=1", "parallel.ep=8"]).cfg
    ep1 = compose(["model=qwen3-30b-a3b", "train.seq_len=131072", "parallel.cp=8",
                   "parallel.dp=1"]).cfg
    assert data_parallel_bytes(ep8, 8, 0, 1) < data_parallel_bytes(ep1, 8, 0, 1) / 4
