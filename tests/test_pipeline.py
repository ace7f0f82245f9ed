"""Pipeline parallelism changes nothing: every schedule, composed with TP + SP, every CP
algorithm, document masking and FSDP/DDP, gives the losses and grad norms of one process over
the same global batch, and after one step every parameter gradient equals the unsharded
model's (the reference is the single-process model: tests/helpers.reference_model).

One process spawn per world size runs every (layout, schedule) of that size; the 4- and 8-rank
worlds and the checkpoint round trips are in the slow tier (one 2-rank world stays fast).
"""

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from lctrain.config.derived import load_balance_of
from lctrain.config.validation import validate
from lctrain.data.batch import IGNORE_INDEX
from lctrain.data.loader import build_loader
from lctrain.layout.stages import bubble_fraction, rank_stages, split_layers, stage_rank
from lctrain.layout.topology import Topology
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.training.loop import train
from lctrain.training.step import micro_steps
from tests.helpers import (
    on_ranks,
    reference_model,
    single_process,
    tiny_config,
    train_each,
    train_on_ranks,
    with_overrides,
)

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2}
"""schedule -> virtual stages per rank"""

LAYOUTS = {  # name -> (world, parallel overrides, data overrides)
    "pp2": (2, {"pp": 2}, {}),
    "pp2_dp2_ddp": (4, {"pp": 2, "dp": 2, "dp_engine": "ddp"}, {}),
    "pp2_tp2_sp": (4, {"pp": 2, "tp": 2, "sp": True}, {}),
    "pp2_cp2_ring_docs": (4, {"pp": 2, "cp": 2, "attention": "ring"}, {"document_masking": True}),
    "pp2_cp2_ulysses": (4, {"pp": 2, "cp": 2, "attention": "ulysses"}, {}),
    "pp4": (4, {"pp": 4}, {}),
    "tp2_sp_cp2_ring_pp2": (8, {"pp": 2, "tp": 2, "sp": True, "cp": 2, "attention": "ring"}, {}),
    "cp4_usp_pp2": (8, {"pp": 2, "cp": 4, "attention": "usp", "ulysses_degree": 2}, {}),
    "pp2_tp2_dp2": (8, {"pp": 2, "tp": 2, "dp": 2}, {}),
    "pp2_tied": (2, {"pp": 2}, {}),
    "pp2_tp2_sp_tied": (4, {"pp": 2, "tp": 2, "sp": True}, {}),
    "pp2_recompute": (2, {"pp": 2}, {}),
    "pp4_recompute": (4, {"pp": 4}, {}),
}
TIED = {"pp2_tied", "pp2_tp2_sp_tied"}
"""The layouts of a model whose output layer is tied to the embedding (first and last stage)."""
RECOMPUTED = {"pp2_recompute", "pp4_recompute"}
"""The layouts whose blocks and MLP tiles are recomputed in the backward (full checkpointing,
train.mlp_chunk): the zero-bubble schedules recompute each twice, for the input gradient and
for the weights'."""
SCHEDULES_OF = {"pp2_dp2_ddp": ("1f1b", "interleaved_1f1b"),
                "pp2_cp2_ring_docs": ("gpipe", "1f1b"), "pp2_cp2_ulysses": ("interleaved_1f1b",),
                "tp2_sp_cp2_ring_pp2": ("interleaved_1f1b",), "cp4_usp_pp2": ("1f1b",),
                "pp2_tp2_dp2": ("gpipe",), "pp2_tied": ("zbv",),
                "pp2_tp2_sp_tied": ("1f1b",), "pp2_recompute": ("zbv",),
                "pp4_recompute": ("zero_bubble",)}
"""The schedules of the layouts that do not run all of them: every schedule runs the layouts
of one dimension besides pp (pp2, pp4, pp2 x tp2 + SP), where the zero-bubble ones are allowed;
the data- and context-parallel layouts and those of three dimensions run one or two each,
different ones (ranks time-sliced on 2 cores cost 1 to 5 s a case). A tied embedding runs zbv
(the first and last stage on one rank) and 1f1b with TP (on two ranks, vocab-sharded)."""


def _config(par: dict, data: dict, schedule: str, dp: int, tied: bool = False,
            recomputed: bool = False):
    p = par["pp"]
    virtual = SCHEDULES[schedule]
    # zbv needs a micro-batch per stage: 2 pp of them
    accum = 2 * p if schedule == "zbv" else p
    recompute = {"activation_checkpointing": "full", "mlp_chunk": 8} if recomputed else {}
    return tiny_config(
        model={"n_layers": 8, "tie_embeddings": tied},
        train={"steps": 2, "global_batch": accum * dp, "micro_batch": 1, **recompute},
        parallel={**par, "pp_schedule": schedule, "pp_virtual_stages": virtual},
        data=data)


def _cases(world: int):
    """(case name, config) of every layout of `world` ranks under each of its schedules
    (`SCHEDULES_OF`; validation refusing the zero-bubble ones with dp x cp > 1 is
    tests/test_validation.py's)."""
    for name, (w, par, data) in LAYOUTS.items():
        if w != world:
            continue
        for schedule in SCHEDULES_OF.get(name, SCHEDULES):
            cfg = _config(par, data, schedule, par.get("dp", 1), tied=name in TIED,
                          recomputed=name in RECOMPUTED)
            problems = validate(cfg, world)
            assert problems == [], (name, schedule, problems)
            yield f"{name}/{schedule}", cfg


def _reference_grads(cfg):
    """Gradients of the unsharded model over the step's global batch, token-weighted."""
    single = single_process(cfg)
    accum = single.train.global_batch // single.train.micro_batch
    loader = build_loader(single, Topology(), 0, accum)
    mbs = loader.next_step()
    tokens = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs)
    model = reference_model(cfg)
    for mb in mbs:
        (model(mb.inputs, positions=mb.positions, doc_ids=mb.doc_ids, labels=mb.labels)
         / tokens).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _reference_key(cfg) -> str:
    """What the one-process reference of a case (gradients, history) depends on."""
    return f"ref_layers{cfg.model.n_layers}_batch{cfg.train.global_batch}_" \
           f"docs{cfg.data.document_masking}_tied{cfg.model.tie_embeddings}"


def _one_step_gradient_error(cfg, ref: dict) -> float:
    """Largest |grad - reference| / max|reference| over every parameter after one step."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
    mbs = loader.next_step()
    local = torch.tensor(float(sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs)),
                         dtype=torch.float64)
    tokens = rt.sum_scores(local) / rt.topology.pp  # every pipeline rank counts the same batch
    micro_steps(model, mbs, rt.topology.group_size("dp_cp") / tokens.item(), rt)
    worst = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        worst = max(worst, float((grad - ref[name]).abs().max() / ref[name].abs().max()))
    return worst


def _run_cases(world: int, root: str, ref_grads: dict) -> dict:
    """{case: (one-step gradient error, 2-step history: the second step after an update)} on
    this rank."""
    out = {}
    for name, cfg in _cases(world):
        error = _one_step_gradient_error(cfg, ref_grads[_reference_key(cfg)])
        out[name] = (error, train(cfg, f"{root}/{name.replace('/', '_')}"))
    return out


@pytest.mark.parametrize("world", [  # all slow: the fast tier's pipeline is test_run_metrics'
    pytest.param(w, marks=pytest.mark.slow) for w in (2, 4, 8)])  # pp2 x tp2 traffic case
def test_every_schedule_and_layout_matches_one_process(world, tmp_path):
    # slow: [8] 17 s and [4] 20 s on 2 cores (3 and 15 cases, ranks time-sliced)
    # every distinct one-process reference: gradients here, once for every rank, and the
    # histories in one more spawn
    singles = {_reference_key(cfg): cfg for _, cfg in _cases(world)}
    ref_grads = {key: _reference_grads(cfg) for key, cfg in singles.items()}
    results = on_ranks(_run_cases, world, world, str(tmp_path), ref_grads, timeout_s=900)
    refs = on_ranks(train_each, 1, {key: single_process(cfg) for key, cfg in singles.items()},
                    str(tmp_path))[0]
    for name, cfg in _cases(world):
        ref = refs[_reference_key(cfg)]
        for rank_results in results:
            error, history = rank_results[name]
            assert error < 1e-4, (name, error)
            assert [h["step"] for h in history] == [1, 2]
            for got, want in zip(history, ref):
                for key_ in ("loss", "grad_norm"):
                    assert got[key_] == pytest.approx(want[key_], rel=1e-4), (name, key_, got,
                                                                            want)


def test_stage_split_and_owners():
    cfg = tiny_config(model={"n_layers": 8}, parallel={"pp": 2, "pp_virtual_stages": 2,
                                                          "pp_schedule": "interleaved_1f1b"})
    assert split_layers(cfg) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert rank_stages(0, 2, 2, "interleaved_1f1b") == [0, 2]
    assert rank_stages(0, 2, 2, "zbv") == [0, 3]
    assert [stage_rank(s, 2, 2, "zbv") for s in range(4)] == [0, 1, 1, 0]
    explicit = with_overrides(cfg, parallel={"pp_layers": [1, 3, 3, 1]})
    assert split_layers(explicit) == ((0,), (1, 2, 3), (4, 5, 6), (7,))


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_the_plan_counts_a_tied_embeddings_copy_as_the_stages_hold_it(schedule):
    """local_params per pipeline rank equals the elements of the stage models that rank holds
    (built on the meta device, counted by tensor: a tied model's last stage holds the copy), and
    AdamW's moments leave the copy out (docs/parallelism.md §27)."""
    from lctrain.models.blocks import sdpa_attention
    from lctrain.parallel.pipeline import stage_model
    from lctrain.planning.state import local_params, state_parts, tied_copy_params

    virtual = SCHEDULES[schedule]
    for tied in (False, True):
        cfg = tiny_config(model={"n_layers": 4, "tie_embeddings": tied},
                          parallel={"pp": 2, "pp_schedule": schedule,
                                    "pp_virtual_stages": virtual})
        for r in range(2):
            held = sum(p.numel() for s in rank_stages(r, 2, virtual, schedule)
                       for p in stage_model(cfg, sdpa_attention, s).parameters())
            assert sum(local_params(cfg, r)) == held, (tied, r)
            holds_last = 2 * virtual - 1 in rank_stages(r, 2, virtual, schedule)
            copy = tied_copy_params(cfg, r)
            assert copy == (cfg.model.vocab_size * cfg.model.dim if tied and holds_last else 0)
            assert state_parts(cfg, 2, r)["optimizer_state"] == 8 * (held - copy)


def test_balanced_split_counts_the_output_layer():
    # a large vocabulary makes the output layer worth several blocks: the last stage holds fewer
    cfg = tiny_config(model={"n_layers": 8, "vocab_size": 8192}, parallel={"pp": 2})
    counts = [len(s) for s in split_layers(cfg)]
    assert sum(counts) == 8 and counts[1] < counts[0]


def test_bubble_formulas():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 2, 2) == pytest.approx(1 / 3)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("zero_bubble", 4, 8, 2) < bubble_fraction("interleaved_1f1b", 4, 8, 2)
    assert bubble_fraction("1f1b", 1, 8) == 0


def _ckpt_cfg(parallel: dict, checkpoint: dict, steps: int = 4):
    return tiny_config(model={"n_layers": 4},
                       train={"steps": steps, "global_batch": 8, "micro_batch": 1},
                       parallel=parallel, checkpoint=checkpoint)


SAVED_AT = {"pp": 2, "tp": 2, "dp": 2}
OTHER_LAYOUTS = [  # (world, parallel)
    (8, {"dp": 8}),
    (8, {"pp": 4, "dp": 2}),
    (8, {"pp": 2, "cp": 2, "dp": 2, "attention": "ulysses"}),
]


def _assert_continues(histories, ref, steps, what):
    for history in histories:
        assert [h["step"] for h in history] == steps, what
        for got, want in zip(history, ref[steps[0] - 1:]):
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-5), what
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), what


def _layout_name(par: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in par.items())


@pytest.mark.slow  # 24 s on 2 cores: 10 runs on 8 ranks
def test_checkpoints_load_across_pipeline_layouts(tmp_path):
    """Saved at (pp2, tp2, dp2), loaded at each other layout, and saved at each of those,
    loaded at (pp2, tp2, dp2): the next losses are the uninterrupted run's. Every run is on 8
    ranks: one spawn runs them all, the saves first."""
    def step2(par):
        return str(tmp_path / _layout_name(par) / "checkpoints" / "step-00000002")

    runs = {_layout_name(par): (world, _ckpt_cfg(par, {"every": 2}))
            for world, par in [(8, SAVED_AT), *OTHER_LAYOUTS]}
    for world, par in OTHER_LAYOUTS:
        runs[f"from_pp2_{_layout_name(par)}"] = (
            world, _ckpt_cfg(par, {"every": 0, "load": step2(SAVED_AT)}))
        runs[f"to_pp2_from_{_layout_name(par)}"] = (
            8, _ckpt_cfg(SAVED_AT, {"every": 0, "load": step2(par)}))
    assert {world for world, _ in runs.values()} == {8}
    histories = train_on_ranks(runs, str(tmp_path), timeout_s=600)
    ref = histories[_layout_name(SAVED_AT)][0]
    for _, par in [(8, SAVED_AT), *OTHER_LAYOUTS]:  # every layout trains the same model
        _assert_continues(histories[_layout_name(par)][:1], ref, [1, 2, 3, 4],
                          "uninterrupted")
    for _, par in OTHER_LAYOUTS:
        _assert_continues(histories[f"from_pp2_{_layout_name(par)}"], ref, [3, 4],
                          f"pp2 tp2 dp2 -> {par}")
        _assert_continues(histories[f"to_pp2_from_{_layout_name(par)}"], ref, [3, 4],
                          f"{par} -> pp2 tp2 dp2")


def _forward_and_export(cfg, out_dir):
    """The pipelined model's logits and loss on every stage's rank, and its export."""
    from lctrain.data.batch import micro_batch_from_tokens
    from lctrain.models.hf import export_hf
    from lctrain.parallel.tensor import loss_value, vocab_parallel

    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1),
                           generator=torch.Generator().manual_seed(3))
    mb = micro_batch_from_tokens(tokens, cfg.train.seq_len, rt.axis_rank("cp"),
                                 rt.topology.cp, load_balance_of(cfg))
    logits = model(mb.inputs, positions=mb.positions, doc_ids=mb.doc_ids)
    with vocab_parallel(rt.topology.tp):
        loss = model(mb.inputs, positions=mb.positions, doc_ids=mb.doc_ids, labels=mb.labels)
    export_hf(model.full_parameters(), cfg.model, out_dir, rt.rank)
    if logits is None:
        return None
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return logits, float(loss_value(loss)), mb.labels


def test_pipeline_forward_evals_and_export_equal_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model={"n_layers": 4},
                      parallel={"pp": 2, "tp": 2, "sp": True, "pp_schedule": "interleaved_1f1b",
                                "pp_virtual_stages": 2})
    out = on_ranks(_forward_and_export, 4, cfg, str(tmp_path / "hf"))
    # stages 0, 2 on pipeline rank 0 (ranks 0, 1), stages 1, 3 (the last) on rank 1 (ranks 2, 3)
    assert out[0] is None and out[1] is None
    model = reference_model(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1),
                           generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(tokens[:, :-1])
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    for logits, got_loss, _ in out[2:]:
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert got_loss == pytest.approx(float(loss), rel=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens[:, :-1]).logits, want, rtol=1e-4, atol=1e-5)


def _in_step(n: int, rank: int, action):
    """train() with action() run on rank `rank` at its n-th step."""
    import torch.distributed as dist

    import lctrain.training.loop as loop

    def run(cfg, run_dir):
        real, calls = loop.train_step, [0]

        def step(*args, **kwargs):
            calls[0] += 1
            if dist.get_rank() == rank and calls[0] == n:
                action(run_dir)
            return real(*args, **kwargs)
        loop.train_step = step
        return train(cfg, run_dir)
    return run


def _sigkill(_run_dir):
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _stop_file(run_dir):
    (Path(run_dir) / "STOP").touch()


def test_a_killed_stage_ends_the_job_and_a_stop_ends_every_stage(tmp_path):
    from lctrain.parallel.launch import RankFailure

    cfg = tiny_config(model={"n_layers": 4}, parallel={"pp": 2},
                      train={"steps": 6, "global_batch": 4, "micro_batch": 1})
    with pytest.raises(RankFailure) as failure:
        on_ranks(_in_step(2, 1, _sigkill), 2, cfg, str(tmp_path / "killed"), timeout_s=120)
    assert failure.value.rank == 1 and "SIGKILL" in str(failure.value)
    # the STOP file appears during step 2 (rank 0 looks for it): both stages stop after step 2
    run = tmp_path / "stopped"
    cfg = with_overrides(cfg, checkpoint={"every": 0})
    histories = on_ranks(_in_step(2, 0, _stop_file), 2, cfg, str(run), timeout_s=120)
    assert [[h["step"] for h in hist] for hist in histories] == [[1, 2], [1, 2]]
    assert (run / "checkpoints" / "step-00000002").is_dir()
