"""`lctrain plan --trace`: the training step on fake tensors and a fake process group at the
layout's world size (lctrain.tracing.trace) against the same step run for real on gloo ranks
(its peak and every part equal, byte for byte), the flash kernels' contract checked in the
trace, the CLI, and the one device seam (no torch.cuda call outside lctrain/device.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lctrain import device
from lctrain.attention import kernels
from lctrain.config.device_rules import VARLEN_TOKENS_MAX, cuda_problems
from lctrain.parallel.launch import RankFailure, run_ranks
from lctrain.parallel.runtime import setup_distributed
from lctrain.planning.estimate import rank_memory
from lctrain.tracing import patches, trace
from lctrain.tracing.live import LiveBytes
from lctrain.training import loop
from tests.helpers import HEADS_8, on_ranks, run_cli, tiny_config

REPO = Path(__file__).resolve().parents[1]


def _real_step(cfgs, static_pipeline: bool = False, traced=None, tries: int = 3):
    """measure_step of each config's real step on this rank (gloo), in order; with
    `static_pipeline` the pipeline stages take their shapes from `stage_io` as in a trace.

    A gloo Work keeps the tensors it was given until its worker thread drops it, which it does
    some time after wait() returned, so now and then a finished collective's buffer is still
    alive at the peak, or alive instead of another of the same size (an NCCL one is free once
    it completes, as in the trace). So each first step runs on a model built afresh up to
    `tries` times: with `traced` (rank 0's trace of each config) until rank 0 measures what the
    trace did (every rank takes that word by an all-reduce, so all run alike), else twice, the
    smaller peak counting."""
    device.Accelerator.traced = static_pipeline  # (a forked rank: nothing to restore)

    def first_step(cfg):
        rt = setup_distributed(cfg)
        model, optimizer, scheduler, loader = loop.build_training(cfg, rt)
        return trace.measure_step(cfg, model, optimizer, scheduler, loader.next_step(), rt)

    if traced is None:
        return [min((first_step(cfg) for _ in range(2)), key=lambda m: m["peak"])
                for cfg in cfgs]
    measured = []
    for cfg, want in zip(cfgs, traced):
        for _ in range(tries):
            got = first_step(cfg)
            unlike = torch.tensor([float(dist.get_rank() == 0 and not _equal(got, want))])
            dist.all_reduce(unlike)
            if not unlike.item():
                break
        measured.append(got)
    return measured


def _equal(real: dict, traced: dict) -> bool:
    return all(real[k] == traced[k] for k in ("peak", "parts", "at"))


def _traced(cfgs, world, cuda, *paths):
    """trace_role of rank 0 for each config (on the CUDA path if `cuda`; each of `paths` too),
    run in a process of its own (a trace sets up and tears down its own fake process group)."""
    return [trace.trace_role(cfg, world, 0, cuda=on) for on in (cuda, *paths) for cfg in cfgs]


def _in_child(fn, *args):
    """fn(*args) in a forked process (a trace's fake world is its own: `trace.trace_apart`)."""
    return run_ranks(fn, 1, args, start_method="fork", threads=1, backend=None,
                     timeout_s=300)[0]


def _same(real: dict, traced: dict) -> None:
    assert traced["peak"] == real["peak"], (traced, real)
    assert traced["parts"] == real["parts"]
    assert traced["at"] == real["at"]
    assert sum(traced["parts"].values()) == traced["peak"]


def _bf16(**sections):
    train = {"dtype": "bf16", **sections.pop("train", {})}
    return tiny_config(train=train, **sections)


FAST = [_bf16(parallel={"cp": 2, "dp": 2, "attention": "ring"},
              data={"document_masking": True})]
SLOW = [
    _bf16(model=HEADS_8, parallel={"cp": 2, "tp": 2, "sp": True, "dp": 1,
                                   "attention": "ulysses"}),
    _bf16(parallel={"cp": 4, "dp": 1, "attention": "usp", "ulysses_degree": 2},
          data={"document_masking": True}),
    _bf16(parallel={"cp": 2, "dp": 2, "attention": "allgather", "dp_engine": "ddp"},
          data={"document_masking": True}),
    _bf16(parallel={"cp": 2, "dp": 2}, train={"activation_checkpointing": "selective"}),
    _bf16(parallel={"cp": 2, "dp": 2}, train={"activation_checkpointing": "full",
                                              "loss_chunk": 8, "mlp_chunk": 8}),
    _bf16(parallel={"cp": 2, "dp": 2, "offload_state": "optimizer"}),
]


@pytest.mark.parametrize("cfgs", [pytest.param(FAST, id="fsdp-cp2-ring-documents"),
                                  pytest.param(SLOW, id="layouts", marks=pytest.mark.slow)])
def test_trace_equals_the_real_step(cfgs):
    """The CPU path traced on fake tensors at world size 4 measures exactly what the same step
    measures on four real gloo ranks: the peak, every part, and where the peak is."""
    traced = _in_child(_traced, cfgs, 4, False, True)
    real = on_ranks(_real_step, 4, cfgs, False, traced[:len(cfgs)])[0]
    for cfg, r, t, on_cuda in zip(cfgs, real, traced, traced[len(cfgs):]):
        _same(r, t)
        assert t["parts"]["activations"] > 0
        # the plan's gradients between accumulation micro-steps (its find, §29): FSDP's
        # unsharded ones alone at these peaks (in a later micro-step, before any
        # reduce-scatter), DDP's beside its buckets
        plan = rank_memory(cfg, 4, 0)["itemised"]["bytes"]
        assert t["parts"]["gradients"] == plan["accumulated_gradients"] + (
            plan["gradients"] if cfg.parallel.dp_engine == "ddp" else 0) > 0
        # the CUDA path: torch's flash ops on their meta kernels, which keep what the CUDA
        # kernels keep (the same state and gradients, activations within a few percent)
        assert {k: on_cuda["parts"][k] for k in ("parameters", "gradients", "optimizer_state")
                } == {k: t["parts"][k] for k in ("parameters", "gradients", "optimizer_state")}
        assert abs(on_cuda["peak"] / t["peak"] - 1) < 0.02


@pytest.mark.slow
def test_pipeline_ranks_traced():
    """pp2 x dp2 (1F1B, 4 micro-batches): one role per pipeline rank, each traced at its own
    rank, equal to the real step's. The trace gives torch's PipelineStage the stage shapes
    (`stage_io`; a real run learns them on its first step by a forward on placeholder inputs
    and object collectives); the real ranks here take them too, which also checks them: torch
    refuses a stage whose tensors differ from them. A fake group's sends keep their tensors
    until waited for, as NCCL's do (`_HeldWork`)."""
    cfg = _bf16(parallel={"pp": 2, "cp": 1, "dp": 2}, train={"global_batch": 8})
    real = on_ranks(_real_step, 4, [cfg], True)
    roles = trace.roles(cfg, 4)
    assert [(rank, pp_rank) for rank, pp_rank, _ in roles] == [(0, 0), (2, 1)]
    for rank, _, _ in roles:
        traced = _in_child(_traced_rank, cfg, 4, rank)
        r = real[rank][0]
        state = ("parameters", "gradients", "optimizer_state")
        assert {k: traced["parts"][k] for k in state} == {k: r["parts"][k] for k in state}
        assert traced["at"] == r["at"] and traced["parts"]["gradients"] > 0
        # gloo keeps a sent tensor until its worker thread drops the Work, after wait() returns
        # (an NCCL send's memory is free once it completes, as in the trace): one micro-batch's
        # hidden state, [1, 32, 64] in bf16, may still be alive at the real step's peak
        assert r["peak"] - traced["peak"] in (0, 1 * 32 * 64 * 2)


@pytest.mark.slow
def test_pipeline_ranks_traced_as_planned():
    """pp4 with two stages per rank and full checkpointing, 8 micro-batches. Interleaved 1F1B:
    every pipeline rank's traced peak within 5% of the plan, whose pipeline buffers count the
    outputs and input gradients the schedule keeps sent until the step ends. Zero bubble: the
    trace runs its split backward (the stage inputs require their gradient, so the weights'
    pass has a graph to start from) and the rank has its weights' gradients, on the first and
    the last pipeline rank (stages 0 and 4, 3 and 7: the first, a middle and the last stage)."""
    for schedule in ("interleaved_1f1b", "zero_bubble"):
        cfg = _bf16(model={"n_layers": 8},
                    parallel={"pp": 4, "dp": 1, "pp_schedule": schedule,
                              "pp_virtual_stages": 2},
                    train={"global_batch": 8, "activation_checkpointing": "full"})
        roles = trace.roles(cfg, 4)
        for rank, pp_rank, _ in roles if schedule == "interleaved_1f1b" else roles[::3]:
            traced = _in_child(_traced_rank, cfg, 4, rank)
            assert traced["parts"]["gradients"] > 0
            if schedule == "interleaved_1f1b":
                plan = rank_memory(cfg, 4, pp_rank)["itemised"]["bytes"]["modelled"]
                assert abs(traced["peak"] / plan - 1) < 0.05, (pp_rank, traced["peak"], plan)


def _traced_rank(cfg, world, rank):
    return trace.trace_role(cfg, world, rank, cuda=False)


def test_the_flash_kernels_contract_is_checked_in_the_trace(monkeypatch):
    """lctrain checks the contract of torch's flash ops in a trace, which their meta kernels do
    not: a query in fp32, or K/V heads that do not divide the query heads, fail it."""
    cfg = FAST[0]
    torch_code = kernels.KERNEL_CODE["torch"]
    forward, backward = torch_code.varlen
    monkeypatch.setattr(torch_code, "varlen", (lambda q, *a: forward(q.float(), *a), backward))
    with pytest.raises(RankFailure, match="fp16 or bf16"):
        _in_child(_traced, [cfg], 4, True)
    monkeypatch.setattr(torch_code, "varlen",
                        (lambda q, k, v, *a: forward(q[:, :3], k, v, *a), backward))
    with pytest.raises(RankFailure, match="GQA"):
        _in_child(_traced, [cfg], 4, True)


def _one_gpu_peaks(cfg, tiles):
    """The traced step of `cfg` at world 1 on the CUDA path, once per RMSNorm tile size."""
    from lctrain.models import norms

    out = []
    for elements in tiles:
        norms.NORM_TILE_ELEMENTS = elements  # (a forked process: nothing to restore)
        out.append(trace.trace_role(cfg, 1, 0, gpus_per_node=1))
    return out


@pytest.mark.slow  # 3 s: two traces
def test_one_gpu_with_the_state_on_the_host_traced():
    """§22's one-GPU layout (FSDP2's CPU offload at dp = 1, full checkpointing, activations
    and the optimizer state on the host, tiles). Each block's gradient leaves the device in
    its post-backward hook, inside autograd's backward, where torch runs no function mode: the
    trace crosses that move too, so no gradient is on the device at the peak. The RMSNorm's
    row tiles bound its float32 working tensors: with tiles of 16 rows of the 512 the peak
    drops by more than three float32 copies of a block's input."""
    cfg = _bf16(parallel={"dp": 1, "offload_state": "optimizer+params"},
                train={"seq_len": 512, "global_batch": 1, "micro_batch": 1,
                       "activation_checkpointing": "full", "offload_activations": True,
                       "mlp_chunk": 128, "loss_chunk": 128},
                slurm={"nodes": 1, "gpus_per_node": 1})
    dim = cfg.model.dim
    whole, tiled = _in_child(_one_gpu_peaks, cfg, (512 * dim, 16 * dim))
    assert whole["parts"]["gradients"] == tiled["parts"]["gradients"] == 0
    assert whole["peak"] - tiled["peak"] > 3 * 4 * 512 * dim


@pytest.mark.slow
def test_plan_trace_on_the_command_line(capsys):
    """`lctrain plan --trace --json` beside the plan (in a new interpreter, as a user runs it):
    every role, its parts summing to its peak, the plan's figures to compare with; the text
    form (in this process) prints the table."""
    args = ["plan", "+recipe=tiny", "--trace"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "train.dtype=fp32 on CUDA" in err
    assert "train.device=cpu traces the CPU path" in err  # the tiny recipe is fp32
    args.append("train.device=cpu")
    cmd = [sys.executable, "-m", "lctrain.cli", *args]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    (role,) = plan["trace"]["roles"]
    assert plan["trace"]["path"] == "cpu" and role["rank"] == 0
    assert sum(role["parts_bytes"].values()) == role["peak_bytes"]
    assert role["plan_modelled_bytes"] == plan["memory_per_rank"]["bytes"]["modelled"]
    assert "lctrain: tracing rank 0" in out.stderr
    code, text, _ = run_cli(args, capsys)
    assert code == 0 and "traced step (lctrain plan --trace" in text
    assert "not seen by the trace" in text


def test_a_failing_trace_is_exit_1_with_its_reason(monkeypatch, capsys):
    """A step that fails in the trace (here a stand-in for the traced rank's failure) ends
    `lctrain plan --trace` with exit 1 and the rank's error, not a traceback of the launcher."""
    def fail(*args):
        raise RankFailure(0, "raised RuntimeError: torch flash-attention contract: GQA")

    monkeypatch.setattr(trace, "trace_apart", fail)
    code, _, err = run_cli(["plan", "+recipe=tiny", "train.device=cpu", "--trace"], capsys)
    assert code == 1 and "does not run as configured at full size" in err and "GQA" in err


def test_trace_refuses_what_it_cannot_run():
    from lctrain.commands.plan_trace import trace_plan
    from lctrain.config import ConfigError

    cfg = tiny_config(parallel={"dp_engine": "deepspeed"})
    with pytest.raises(ConfigError, match="dp_engine=fsdp"):
        trace_plan(cfg, 4, {"memory_per_rank": {"bytes": {}}})


def test_varlen_calls_over_int32_are_refused_on_cuda():
    cfg = tiny_config(data={"document_masking": True}, train={"dtype": "bf16"})
    cfg.train.seq_len, cfg.train.micro_batch = 2**30, 2
    assert any("int32 offsets" in p and f"{VARLEN_TOKENS_MAX:,}" in p
               for p in cuda_problems(cfg))
    cfg.train.micro_batch = 1
    assert not any("int32" in p for p in cuda_problems(cfg))


def test_one_device_seam():
    """Every torch.cuda call and CUDA-path decision of the package is in lctrain/device.py."""
    pattern = re.compile(r'torch\.cuda\.|\.is_cuda\b|\.type [!=]= "cuda"')
    found = [f"{path.relative_to(REPO)}:{n}" for path in (REPO / "lctrain").rglob("*.py")
             if path.name != "device.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line.split("#")[0]) and '"""' not in line]
    assert found == [], found


def test_every_torch_patch_of_the_trace_still_applies_and_is_undone():
    """The trace's patches of torch internals (lctrain/tracing/patches.py) all find their
    target in this torch; one that would not is named; `patched` restores the attribute, or
    removes it again where the owner inherited it."""
    assert patches.problems() == [], f"torch {torch.__version__}: {patches.problems()}"
    gone = patches.Patch("torch.distributed.pipelining.schedules", "_no_such_thing", "a test")
    assert patches.problems((gone,)) == [
        "torch.distributed.pipelining.schedules._no_such_thing: no such callable"]
    inherited = "cpu" not in torch.Tensor.__dict__
    with patches.patched({patches.TENSOR_CPU: lambda original: lambda t: "patched"}):
        assert torch.zeros(1).cpu() == "patched"
    assert torch.zeros(1).cpu().shape == (1,) and ("cpu" not in torch.Tensor.__dict__) == inherited


def test_live_bytes_follows_storages_views_resizes_and_collectives():
    """LiveBytes, the one tracker (lctrain/tracing/live.py), against bytes counted by hand: a
    new storage from its op until its last reference goes (a view keeps it), at its size after a
    resize; a storage made before only with `views`, and only while a view made inside lives;
    excluded storages never; the peak; and on a gloo group, a collective's buffers released
    before `settle` returns."""
    before, param = torch.ones(64), torch.ones(32)  # 256 and 128 bytes, made before
    tracker = LiveBytes(exclude={id(param.untyped_storage())}, views=True)
    with tracker:
        a = torch.zeros(100)  # 400 bytes
        view = a[:10]
        del a
        assert tracker.alive_by_where() == {"other": 400}  # the view holds the storage
        tracker.where = "labels"
        seen = before.view(8, 8)  # made before: counted while this view lives
        _ = param.view(4, 8)  # excluded
        assert tracker.alive_by_where() == {"other": 400, "labels": 256}
        del seen
        assert tracker.alive_by_where() == {"other": 400}
        view.untyped_storage().resize_(1000)  # 1000 bytes now
        b = torch.ones(10)  # 40 bytes
        assert sum(tracker.by_phase.values()) == 1040
        del view, b
    assert tracker.alive() == [] and tracker.peak == 1040  # the storage resized, then b


def _collective_released() -> list[int]:
    tracker = LiveBytes()
    with tracker:
        x = torch.full((1000,), float(dist.get_rank()))
        dist.all_reduce(x * 2)  # a temporary only the Work holds once this returns
        tracker.settle()
        left = sum(tracker.by_phase.values())
        del x
    return [left, sum(tracker.by_phase.values())]


def test_live_bytes_settles_a_gloo_collective():
    """A gloo Work drops the tensors it was given some time after wait() returned; `settle`
    waits for that, so only the program's own tensors are alive after it."""
    assert on_ranks(_collective_released, 2) == [[4000, 0]] * 2
