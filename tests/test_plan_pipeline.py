"""The plan under pipeline parallelism: each pipeline rank holds the parameters of its own
stages (they add up to the model), its stages keep the micro-batches in flight that torch's
schedules actually leave waiting for their backward, and `lctrain plan` prints the per-stage
table (docs/parallelism.md §13). No process is started: torch's schedule classes build the
whole pipeline's order in their constructor from the stages' ranks and counts alone."""

import json
from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.pipelining.schedules import _ComputationType

from lctrain.config.compose import compose
from lctrain.config.model_size import param_count
from lctrain.config.validation import validate
from lctrain.layout.stages import rank_stages
from lctrain.parallel.pipeline import SCHEDULES
from lctrain.planning.activations import activation_formula, head_activation_formula
from lctrain.planning.estimate import GIB, build_plan
from lctrain.planning.schedule import in_flight_moments, peak_in_flight
from lctrain.planning.state import local_params, stage_params
from tests.helpers import run_cli, tiny_config


def _pipeline_config(world: int, **parallel):
    cfg = tiny_config(parallel=parallel, train={"global_batch": 8})
    cfg.model.n_layers = 8
    assert validate(cfg, world) == [], parallel
    return cfg


@pytest.mark.parametrize("parallel", [
    {"pp": 4},                                                          # balanced
    {"pp": 4, "pp_layers": [1, 3, 3, 1]},                               # explicit, uneven
    {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 3,
     "pp_layers": [1, 2, 1, 1, 2, 1]},                                  # virtual stages
    {"pp": 2, "pp_schedule": "zbv", "pp_virtual_stages": 2},            # V: rank 0 first + last
    {"pp": 4, "pp_schedule": "zbv", "pp_virtual_stages": 2},
    {"pp": 2, "pp_schedule": "gpipe"},
])
def test_pipeline_ranks_hold_the_whole_model_once(parallel):
    cfg = _pipeline_config(parallel["pp"], **parallel)
    pp, stages = parallel["pp"], range(parallel["pp"] * parallel.get("pp_virtual_stages", 1))
    assert sum(sum(local_params(cfg, r)) for r in range(pp)) == param_count(cfg.model)
    assert sum(stage_params(cfg, s) for s in stages) == param_count(cfg.model)
    # the embedding on the rank of stage 0, the final norm and output layer on that of the last
    vocab, dim = cfg.model.vocab_size * cfg.model.dim, cfg.model.dim
    last_rank = 0 if parallel.get("pp_schedule") == "zbv" else pp - 1
    roots = [local_params(cfg, r)[1] for r in range(pp)]
    assert roots == [vocab * (r == 0) + (vocab + dim) * (r == last_rank) for r in range(pp)]


def _torch_order(schedule: str, pp: int, microbatches: int, virtual: int) -> dict:
    """torch's pipeline order (pipeline rank -> actions), built by the schedule class from
    stand-ins for pipeline rank 0's stages: the constructor reads only their ranks and counts."""
    def stage(index: int) -> SimpleNamespace:
        return SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * virtual,
                               stage_index=index, submod=nn.Identity(), is_first=index == 0,
                               is_last=index == pp * virtual - 1)

    stages = [stage(s) for s in rank_stages(0, pp, virtual, schedule)]
    cls = SCHEDULES[schedule]
    built = cls(stages[0] if schedule in ("gpipe", "1f1b") else stages,
                n_microbatches=microbatches)
    return built.pipeline_order


def _torch_moments(actions: list, stages: list[int], frees) -> list[tuple[int, ...]]:
    """Micro-batches each stage holds after each forward of the rank: a forward adds one, the
    action in `frees` (the full backward, or the weight gradient W) releases one."""
    held, moments = dict.fromkeys(stages, 0), []
    for action in filter(None, actions):
        if action.computation_type == _ComputationType.FORWARD:
            held[action.stage_index] += 1
            moments.append(tuple(held[s] for s in stages))
        elif action.computation_type == frees:
            held[action.stage_index] -= 1
    return moments


@pytest.mark.parametrize("schedule,pp,microbatches,virtual", [
    ("gpipe", 4, 6, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 9, 1), ("1f1b", 2, 5, 1),
    ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 16, 2), ("interleaved_1f1b", 4, 10, 2),
    ("interleaved_1f1b", 4, 3, 2), ("interleaved_1f1b", 2, 6, 3), ("interleaved_1f1b", 3, 12, 4),
    ("zero_bubble", 4, 8, 2), ("zero_bubble", 4, 10, 2), ("zero_bubble", 4, 3, 2),
    ("zero_bubble", 2, 6, 3), ("zero_bubble", 3, 12, 4),
    ("zbv", 4, 8, 2), ("zbv", 4, 16, 2), ("zbv", 2, 5, 2), ("zbv", 3, 7, 2),
])
def test_in_flight_micro_batches_match_torch_schedules(schedule, pp, microbatches, virtual):
    zero_bubble = schedule in ("zero_bubble", "zbv")
    frees = _ComputationType.BACKWARD_WEIGHT if zero_bubble else _ComputationType.FULL_BACKWARD
    order = _torch_order(schedule, pp, microbatches, virtual)
    for r in range(pp):
        stages = rank_stages(r, pp, virtual, schedule)
        torch_moments = _torch_moments(order[r], stages, frees)
        ours = in_flight_moments(schedule, pp, microbatches, virtual, r)
        n = len(stages)
        # bytes per micro-batch of each stage: alike, one stage alone (its own peak), uneven
        for weights in [(1,) * n, *[tuple(int(i == j) for i in range(n)) for j in range(n)],
                        tuple(range(2, 2 + n)), tuple(range(n + 5, 5, -1)), (7, 1, 3, 2)[:n]]:
            want = max(sum(c * w for c, w in zip(counts, weights)) for counts in torch_moments)
            got = sum(c * w for c, w in zip(peak_in_flight(ours, weights), weights))
            assert got == want, (schedule, pp, microbatches, virtual, r, weights)


# recipes/llama-256k.yaml's layout on the llama3-8b preset: the keys the recipe requires given as
# null, synthetic data (tests/test_recipes.py plans the recipes with a checkpoint and a corpus)
LLAMA_256K = ["+recipe=llama-256k", "model.init_from=null", "model.hf_overrides=[]",
              "data.source=synthetic", "data.path=null", "data.tokenizer=null"]


def test_plan_of_one_pipeline_rank_keeps_the_meaning_of_its_keys():
    cfg = compose(LLAMA_256K).cfg
    plan = build_plan(cfg, 256)
    a = activation_formula(cfg, 256, 1)
    head = head_activation_formula(cfg, 256, 1)
    assert plan["memory_gib"]["activations_kept"] == pytest.approx((32 * a + head) / GIB)
    assert plan["shapes"]["layers_per_stage"] == [32] and "pipeline" not in plan
    assert "pipeline_buffers" not in plan["memory_gib"]


PP4 = [*LLAMA_256K, "parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b",
       "parallel.pp_virtual_stages=2", "launch.nproc=256"]


def test_plan_prints_the_pipeline_stage_by_stage(capsys):
    code, out, _ = run_cli(["plan", *PP4, "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    pipe = plan["pipeline"]
    assert plan["shapes"]["layers_per_stage"] == [4] * 8 and plan["grad_accum"] == 16
    assert pipe["micro_batches"] == 16 and pipe["bubble_fraction"] == pytest.approx(3 / 35)
    assert [row["pp_rank"] for row in pipe["stages"]] == [0, 1, 2, 3] * 2
    assert sum(row["params"] for row in pipe["stages"]) == 8_030_261_248
    # warm-up of rank r: 4 + 2 (3 - r) chunk forwards, then one more before the first backward;
    # rank 0 peaks one op later (a forward of stage 0 and a backward of stage 4): stage 0 keeps
    # more per micro-batch, stage 4's input being its receive buffer
    in_flight = [row["micro_batches_in_flight"] for row in pipe["stages"]]
    assert in_flight == [8, 5, 4, 4, 3, 4, 3, 1]
    totals = {row["pp_rank"]: row["rank_total_gib"] for row in pipe["stages"]}
    assert plan["memory_gib"]["total"] == max(totals.values())
    assert totals[pipe["largest_pp_rank"]] == max(totals.values())
    _, text, _ = run_cli(["plan", *PP4], capsys)
    assert "pipeline: interleaved_1f1b, 2 stage(s) per rank, 16 micro-batches per step" in text
    table = text.split("pipeline: ")[1].split("\n\n")[0].splitlines()[2:]
    assert len(table) == 8
    assert table[0].split()[:6] == ["0", "0", "0-3", "embedding", "1.398B", "8"]
    assert table[7].split()[:6] == ["7", "3", "28-31", "output", "1.398B", "1"]
