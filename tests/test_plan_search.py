"""plan.search (lctrain.planning.search, docs/parallelism.md §17): for the 256K recipe on its
256 GPUs the ranked layouts each validate, fit and predict what `lctrain plan` predicts for them
alone, and the winner is at least as fast as the recipe's own layout; on a small world the
search considers exactly the layouts an independent brute force over every key finds valid;
what does not fit is dropped; and `lctrain plan` prints its step time. (The winner of a CPU
search trains: tests/test_auto_layout.py.)"""

import copy
import itertools
import json
import os

import pytest

from lctrain.config import derive
from lctrain.config.compose import compose
from lctrain.config.validation import validate
from lctrain.planning import search as search_module
from lctrain.planning.estimate import build_plan
from lctrain.planning.hardware import hardware_from_plan
from lctrain.planning.search import search
from lctrain.planning.timing import step_time_summary
from lctrain.prepare.checks import preflight
from lctrain.prepare.init_from import resolve_model
from tests.helpers import run_cli, tiny_config
from tests.test_recipes import inputs  # noqa: F401  (the production recipes' required keys)


def _cli_json(args: list[str], capsys) -> dict:
    code, out, _ = run_cli(args, capsys)
    assert code == 0, out
    return json.loads(out)


@pytest.mark.slow  # 10 s on 2 cores; the small world's search stays fast
def test_the_256k_search_ranks_layouts_that_validate_fit_and_beat_the_recipe(inputs, capsys):  # noqa: F811
    recipe = ["+recipe=llama-256k", *inputs("llama-256k")]
    found = _cli_json(["plan", *recipe, "plan.search=true", "--json"], capsys)
    assert found["world_size"] == 256 and found["hardware"] == "plan.*"
    assert found["layouts"] == found["fitting"] + found["too_big"] > 1000
    top = found["top"]
    assert len(top) == 10
    speeds = [row["tokens_per_s_per_rank"] for row in top]
    assert speeds == sorted(speeds, reverse=True)
    for row in top:  # each, selected by its overrides alone, is what the search says it is
        cfg = resolve_model(compose([*recipe, *row["command_line"].split()])).cfg
        assert preflight(cfg, 256) == [], row["command_line"]
        mem = build_plan(cfg, 256)["memory_per_rank"]
        assert mem["verdict"] == "FITS" and mem["total_gib"] <= 80
        assert row["memory_gib"] == pytest.approx(mem["total_gib"])
        alone = step_time_summary(cfg, 256, hardware_from_plan(cfg))
        assert alone["tokens_per_s_per_rank"] == pytest.approx(row["tokens_per_s_per_rank"])
    base = resolve_model(compose(recipe)).cfg
    own = step_time_summary(base, 256, hardware_from_plan(base))
    assert speeds[0] >= own["tokens_per_s_per_rank"]


def _canonical(p: dict) -> tuple:
    """A layout with the keys its sizes make irrelevant at their defaults, and USP at Ulysses
    degree 1 or cp named as the ring or Ulysses it is."""
    cp, pp, attention, u = p["cp"], p["pp"], p["attention"], p["ulysses_degree"]
    if cp == 1 or (attention == "usp" and u == 1):
        attention, u = "ring", 1
    elif attention == "usp" and u == cp:
        attention, u = "ulysses", 1
    return (p["tp"], p["sp"] if p["tp"] > 1 else False, cp, attention, u,
            pp, p["pp_schedule"] if pp > 1 else "1f1b", p["pp_virtual_stages"] if pp > 1 else 1,
            p["dp"], p["dp_engine"], p.get("zero_stage"))


def test_the_search_considers_every_valid_layout_of_a_small_world():
    cfg = tiny_config(train={"global_batch": 8, "micro_batch": 1},
                      plan={"gpu_memory_gib": 1e6}, model={"n_layers": 4})
    world = 4
    expected = set()
    sizes = [s for s in itertools.product((1, 2, 4), repeat=4) if s[0] * s[1] * s[2] * s[3] == 4]
    for (tp, cp, pp, dp), attention, u, (schedule, v), (engine, stage) in itertools.product(
            sizes, ("ring", "ulysses", "allgather", "usp"), (1, 2, 4),
            itertools.product(("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv"),
                              (1, 2, 4)),
            (("fsdp", None), ("ddp", None), ("deepspeed", 1), ("deepspeed", 2),
             ("deepspeed", 3))):
        p = {"tp": tp, "sp": tp > 1, "cp": cp, "attention": attention, "ulysses_degree": u,
             "pp": pp, "pp_schedule": schedule, "pp_virtual_stages": v, "dp": dp,
             "dp_engine": engine}
        c = tiny_config(train={"global_batch": 8, "micro_batch": 1}, model={"n_layers": 4},
                        parallel=p, deepspeed={} if stage is None else {"zero_stage": stage})
        if not validate(c, world):
            expected.add(_canonical(p | {"zero_stage": stage}))
    result = search(cfg, world, hardware_from_plan(cfg))
    found = {_canonical({k.split(".")[1]: v for k, v in c.overrides.items()})
             for c in result.ranked}
    assert result.too_big == 0 and result.layouts == len(result.ranked) == len(found)
    assert found == expected


def test_what_does_not_fit_is_dropped():
    cfg = tiny_config(train={"global_batch": 8, "micro_batch": 1})
    roomy = search(cfg, 4, hardware_from_plan(cfg))
    sizes = sorted(c.memory_gib for c in roomy.ranked)
    cfg.plan.gpu_memory_gib = sizes[len(sizes) // 2]
    tight = search(cfg, 4, hardware_from_plan(cfg))
    assert tight.layouts == roomy.layouts == len(tight.ranked) + tight.too_big
    assert 0 < len(tight.ranked) < len(roomy.ranked)
    assert all(c.memory_gib <= cfg.plan.gpu_memory_gib for c in tight.ranked)
    # a layout fits with checkpointing or tiling where it does not without
    assert any(c.overrides["train.activation_checkpointing"] != "none"
               or c.overrides["train.loss_chunk"] for c in tight.ranked)


@pytest.mark.slow  # 5 s: the search twice
def test_forked_workers_rank_what_one_process_ranks(monkeypatch):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU core: the search never forks workers")
    cfg = tiny_config(train={"global_batch": 32, "micro_batch": 1, "seq_len": 256},
                      model={"n_layers": 8})
    # some fit only with checkpointing, tiling or state on the host, some in none
    cfg.plan.gpu_memory_gib = 1.0025
    results = {}
    for name, threshold in (("one", 10**9), ("forked", 1)):
        monkeypatch.setattr(search_module, "PARALLEL_FROM", threshold)
        results[name] = search(cfg, 16, hardware_from_plan(cfg))
    one, forked = results["one"], results["forked"]
    assert (forked.layouts, forked.evaluated, forked.too_big) == (
        one.layouts, one.evaluated, one.too_big)
    assert [c.overrides for c in forked.ranked] == [c.overrides for c in one.ranked]
    assert [c.step.total_s for c in forked.ranked] == [c.step.total_s for c in one.ranked]
    # tiling cuts each layout's own sequence per rank into 8 chunks
    tiled = [c for c in one.ranked if c.overrides["train.loss_chunk"]]
    assert tiled and one.too_big
    assert any(c.overrides["parallel.offload_state"] != "none" for c in one.ranked)
    for c in tiled:
        assert c.overrides["train.loss_chunk"] == 256 // c.overrides["parallel.cp"] // 8


def test_plan_prints_the_predicted_step(capsys):
    plan = _cli_json(["plan", "+recipe=tiny", "--json"], capsys)
    t = plan["step_time"]
    cfg = compose(["+recipe=tiny"]).cfg
    tokens = derive(cfg, 4).tokens_per_step
    assert t["tokens_per_s"] == pytest.approx(tokens / t["total_s"])
    assert t["total_s"] == pytest.approx(t["compute_s"] + t["exposed_comm_s"]
                                         + t["fixed_costs_s"] + t["bubble_s"] + t["offload_s"])
    _, out, _ = run_cli(["plan", "+recipe=tiny"], capsys)
    assert "predicted step time (docs/parallelism.md §15):" in out
    # whose rates: plan.*'s GPU figures, and on a machine without a GPU where this one trains
    assert f"  rates: {t['rates']}" in out and t["rates"].startswith("GPU figures from plan.*")
    assert f"{t['tokens_per_s_per_rank']:,.0f} tokens/s per rank" in out


def test_the_search_passes_the_state_or_splits_the_heads_of_linear_layers():
    """A hybrid's layouts are searched both ways at cp > 1 (parallel.linear_cp), the head split
    only where the key heads divide cp; the same layout costs the head split no first pass of
    the recurrence (less recomputed) and state passing fewer bytes on the cp group; every
    candidate validates."""
    cfg = tiny_config(train={"global_batch": 8, "micro_batch": 1, "seq_len": 256},
                      plan={"gpu_memory_gib": 1e6},
                      model={"family": "qwen3_5_text", "n_layers": 4,
                             "layer_types": ["linear_attention", "linear_attention",
                                             "linear_attention", "full_attention"],
                             "linear_key_heads": 2, "linear_value_heads": 4,
                             "linear_key_dim": 16, "linear_value_dim": 16})
    hw = hardware_from_plan(cfg)
    result = search(cfg, 4, hw)
    ways = {(c.overrides["parallel.cp"], c.overrides["parallel.linear_cp"])
            for c in result.ranked}
    assert ways == {(1, "state"), (2, "state"), (2, "heads"), (4, "state")}
    for c in result.ranked:
        chosen = copy.deepcopy(cfg)
        for key, value in c.overrides.items():
            section, name = key.split(".")
            setattr(getattr(chosen, section), name, value)
        assert validate(chosen, 4) == [], c.overrides
    pairs = {}
    for c in result.ranked:
        if c.overrides["parallel.cp"] == 2:
            layout = tuple(sorted((k, v) for k, v in c.overrides.items()
                                  if k != "parallel.linear_cp"))
            pairs.setdefault(layout, {})[c.overrides["parallel.linear_cp"]] = c.step
    both = [p for p in pairs.values() if len(p) == 2]
    assert both
    for p in both:
        assert p["state"].recompute_s > p["heads"].recompute_s
        assert p["state"].comm_s["cp"] < p["heads"].comm_s["cp"]
