"""The registries of the choices that grow, walked, so that docs/extending.md stays true: every
context-parallel algorithm has its facts (Ulysses degree, traffic, memory, timing), its
implementation, its place in the schema, its documentation and its test cases; every attention
kernel backend is in the schema, the kernel tables and the device rules. And a toy algorithm
added by the checklist alone validates, plans, trains like one process and sends what its
formula says, then leaves no trace once unregistered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path

import pytest

from lctrain.attention import CP_ATTENTION, registered
from lctrain.attention import kernels as kernels_module
from lctrain.config import ParallelConfig, TrainConfig, choices_of, derive
from lctrain.config.cp_algorithms import CP_ALGORITHMS, HEADS_OVER
from lctrain.config.device_rules import kernel_device_problems
from lctrain.config.kernel_backends import KERNEL_BACKENDS, backends_on
from lctrain.config.keys import keys
from lctrain.config.validation import validate
from lctrain.layout.topology import GROUPS
from lctrain.planning.cp_costs import CP_COSTS, LayerShape
from lctrain.planning.estimate import build_plan
from lctrain.planning.hardware import Hardware
from lctrain.planning.search import attentions
from lctrain.planning.timing import (
    CALIBRATED_LAYOUTS,
    StepShape,
    calibrated_layout,
    collective_calls,
    predict_step_time,
)
from lctrain.planning.traffic import attention_traffic, cp_step_bytes
from tests import toy_cp_algorithm as toy
from tests.helpers import on_ranks, tiny_config
from tests.test_attention_cp import cases_for, run_cases
from tests.test_train_parity import CP_LAYOUTS

ROOT = Path(__file__).resolve().parents[1]


def _key_entries(name: str) -> dict[str, str]:
    """What `lctrain keys` lists under the key: each registered name with its summary."""
    return dict(next(k for k in keys(name.split(".")[0]) if k.name == name).registered)


def _gpu_check_cases():
    """tools/gpu_checks/cp.py's cases, imported (they come from the registry)."""
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return importlib.import_module("gpu_checks.cp").CP_CASES
    finally:
        sys.path.remove(str(ROOT / "tools"))


SHAPE = LayerShape(batch=2, seq_len=64, cp=4, ulysses=2, tp=1, dim=64, heads=4, kv_heads=2,
                   kv_replication=1, compute_bytes=2)


def test_facts_implementations_and_schema_name_the_same_algorithms():
    names = tuple(CP_ALGORITHMS)
    assert names == tuple(CP_ATTENTION) == tuple(CP_COSTS) == choices_of(ParallelConfig, "attention")
    assert ParallelConfig().attention in names
    listed = _key_entries("parallel.attention")  # `lctrain keys` shows each with its summary
    assert tuple(listed) == names and all(listed.values())


@pytest.mark.parametrize("name", list(CP_ALGORITHMS))
def test_every_algorithm_has_every_entry(name):
    a, run, costs = CP_ALGORITHMS[name], CP_ATTENTION[name], CP_COSTS[name]
    assert a.heads_over in HEADS_OVER and a.degree(1, 3) == 1
    assert a.degree_key is None or a.degree_key.removeprefix("parallel.") in {
        f.name for f in dataclasses.fields(ParallelConfig)}
    # traffic: at every degree the search tries, collectives on named groups, forward and back
    for cp in (2, 4, 8):
        for setting in a.searched_degrees(cp):
            u = a.degree(cp, setting)
            assert cp % u == 0, (name, cp, u)
            xs = costs.transfers(1024, 64, 32, cp, u)
            assert {x.direction for x in xs} == {"fwd", "bwd"}, (name, cp, u)
            for x in xs:
                assert x.group in GROUPS and x.elements > 0 and x.calls > 0, x
            total = attention_traffic(name, 1024, 64, 32, cp, setting)
            assert total["forward"] > 0 and total["backward"] > 0
    # memory and timing terms answer for any layer
    for term in (costs.memory.kept_per_token, costs.memory.buffers):
        assert term(SHAPE) >= 0
    assert costs.memory.block_tokens(128, 4) >= 128  # every token at least once
    for feature, times in costs.timing.fixed_costs(2, 2).items():
        assert feature in {c.name for c in CALIBRATED_LAYOUTS} and times >= 0, (name, feature)
    if costs.timing.calibrated:
        assert calibrated_layout(name).parallel["attention"] == name
    # the implementation: one module, its own file, listed in docs/architecture.md
    module = run.attend.__module__
    assert module.startswith("lctrain.attention."), module
    assert f"{module.rsplit('.', 1)[1]}.py" in (ROOT / "docs/architecture.md").read_text()
    assert f"- `{name}`:" in (ROOT / "README.md").read_text()  # the README's list of values
    # its formulas derived in the section it names
    section = re.fullmatch(r"docs/parallelism\.md §(\d+)", a.doc).group(1)
    assert re.search(rf"^## {section}\. ", (ROOT / "docs/parallelism.md").read_text(), re.M)


@pytest.mark.parametrize("name", list(CP_ALGORITHMS))
def test_every_algorithm_is_tested(name):
    """Against the float64 reference with its traffic formula (tests/test_attention_cp.py,
    whose cases come from the registry), in training against one process
    (tests/test_train_parity.py) and on a GPU (tools/gpu_checks/cp.py)."""
    assert any(c["algorithm"] == name for w in (2, 4, 8) for c in cases_for(w))
    assert any(par.get("attention") == name for _, par in CP_LAYOUTS)
    assert any(case[0] == name for case in _gpu_check_cases())
    assert any(a == name for cp in (2, 4, 8) for a, _ in attentions(cp))  # plan.search


def test_every_kernel_backend_is_in_the_schema_the_tables_and_the_device_rules():
    backends = tuple(KERNEL_BACKENDS)
    assert tuple(kernels_module.KERNEL_CODE) == backends  # facts and code, name by name
    assert set(choices_of(TrainConfig, "attention_kernel")) == {"auto", *backends}
    for b in backends:  # a varlen backend has a varlen kernel, and only then
        assert (kernels_module.KERNEL_CODE[b].varlen is not None) == KERNEL_BACKENDS[b].varlen
    listed = _key_entries("train.attention_kernel")
    assert tuple(listed) == backends and all(listed.values())
    for b in backends:
        cfg = tiny_config(train={"attention_kernel": b})
        cuda_only = b in backends_on("cuda")
        assert bool(kernel_device_problems(cfg, "cpu")) == cuda_only, b
        assert bool(kernel_device_problems(cfg, "cuda")) != cuda_only, b


def test_a_registered_kernel_backend_is_valid_and_runs_the_attention():
    """A kernel backend is its facts and its code, each registered under its name: the schema,
    the device rules and the kernel layer take it from there (docs/extending.md)."""
    import torch

    from lctrain.attention.calls import Block
    from lctrain.attention.kernels import KernelCode, KernelOptions
    from lctrain.attention.local import local_attention
    from lctrain.config.kernel_backends import KernelBackend

    cpu, calls = kernels_module.KERNEL_CODE["cpu"], []

    def counted(i):
        return lambda *args: calls.append(i) or cpu.dense[i](*args)

    facts = KernelBackend("toy_cpu", "cpu", "the cpu kernels, counted")
    code = KernelCode("toy_cpu", (counted(0), counted(1)))
    q, k, v = (torch.randn(1, 8, h, 4, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))
    block = Block(torch.arange(8), None)

    def attend(backend):
        out, _ = local_attention(q, k, v, block, block, causal=True, scale=0.5,
                                 options=KernelOptions(backend=backend))
        return out, torch.autograd.grad(out.sum(), (q, k, v))

    with KERNEL_BACKENDS.registered(facts), kernels_module.KERNEL_CODE.registered(code):
        cfg = tiny_config(train={"attention_kernel": "toy_cpu", "device": "cpu"})
        assert validate(cfg, cfg.parallel.cp) == []
        assert kernel_device_problems(cfg, "cuda")  # a CPU backend, refused on CUDA
        (out, grads), (want, want_grads) = attend("toy_cpu"), attend("cpu")
        assert calls == [0, 1] and torch.equal(out, want)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert "toy_cpu" not in choices_of(TrainConfig, "attention_kernel")


def test_a_registration_is_undone_and_a_name_registers_once():
    with pytest.raises(ValueError, match="registered already"):
        with registered(CP_ALGORITHMS["ring"], CP_ATTENTION["ring"]):
            pass
    assert tuple(CP_ALGORITHMS) == tuple(CP_ATTENTION) == ("ulysses", "ring", "usp", "allgather")
    with pytest.raises(RuntimeError, match="inside"):
        with toy_registered():
            assert toy.NAME in CP_ALGORITHMS and toy.NAME in CP_ATTENTION
            raise RuntimeError("inside")
    assert toy.NAME not in CP_ALGORITHMS and toy.NAME not in CP_ATTENTION


# ---- the toy algorithm, end to end ---------------------------------------------------------

@contextlib.contextmanager
def toy_registered():
    """The toy's three entries: facts and code (`lctrain.attention.registered`), and costs (the
    planner's, which the attention layer does not import)."""
    with registered(toy.FACTS, toy.ATTENTION), CP_COSTS.registered(toy.COSTS):
        yield


def _train(cfg, run_dir):
    from lctrain.training.loop import train

    return train(cfg, run_dir)


def _toy_cases(world: int, limit: int | None = None) -> list[dict]:
    """All-gather's cases of tests/test_attention_cp.py, run by the toy instead."""
    cases = [dict(c, algorithm=toy.NAME) for c in cases_for(world) if c["algorithm"] == "allgather"]
    return cases[:limit]


def test_a_toy_algorithm_validates_plans_trains_and_meets_its_traffic_formula(tmp_path):
    cfg = tiny_config(parallel={"cp": 2, "attention": toy.NAME, "dp": 1},
                      train={"steps": 3, "global_batch": 2, "micro_batch": 1})
    assert any(f"parallel.attention={toy.NAME!r} is not one of" in p for p in validate(cfg, 2))
    hw = Hardware(device_tflops=1e-3, intra_node_gbps=1.0, inter_node_gbps=0.1)
    with toy_registered():
        # validates; `lctrain keys` lists it; the plan, the step time and the search ask for it
        assert validate(cfg, 2) == []
        assert toy.NAME in next(k for k in keys("parallel") if k.name == "parallel.attention").allowed
        assert derive(cfg, 2).cp_ulysses == 1
        plan = build_plan(cfg, 2)
        per_layer = 1 * 2 * 16 * 32  # (P-1) x K and V x L/P tokens x d_kv (2 heads of 16)
        layers_steps = 2 * 2  # 2 blocks x 2 micro-batches
        assert plan["predicted"]["cp_collectives"] == {
            "all_gather_fwd": 4 * per_layer * layers_steps,
            "reduce_scatter_bwd": 4 * per_layer * layers_steps}
        assert collective_calls(StepShape.of(cfg, 2)) == {"cp": 2 * 2 * layers_steps}
        assert set(predict_step_time(cfg, 2, hw).comm_s) == {"cp", "dp"}
        assert (toy.NAME, 1) in attentions(2)
        # against the float64 reference, traffic counted = the formula (elements and bytes)
        for world, limit in ((2, None), (4, 3)):
            cases = _toy_cases(world, limit)
            assert on_ranks(run_cases, world, cases, timeout_s=300) == [len(cases)] * world
        # trains like one process, and logs the bytes its formula predicts
        ref = on_ranks(_train, 1, tiny_config(train={"steps": 3, "global_batch": 2,
                                                     "micro_batch": 1}),
                       str(tmp_path / "ref"))[0]
        for history in on_ranks(_train, 2, cfg, str(tmp_path / "toy")):
            for got, want in zip(history, ref, strict=True):
                assert got["loss"] == pytest.approx(want["loss"], rel=2e-5)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-5)
                assert got["cp_bytes_sent"] == sum(cp_step_bytes(cfg, 2).values())
    assert toy.NAME not in CP_ALGORITHMS and toy.NAME not in CP_ATTENTION
    assert any(f"parallel.attention={toy.NAME!r} is not one of" in p for p in validate(cfg, 2))
