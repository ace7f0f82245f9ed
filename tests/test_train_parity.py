"""Data parallelism and accumulation change nothing: losses and grad norms equal one process.

References are independent of the distributed path: a single process over the same global batch,
and for the token weighting a plain mean cross-entropy over all valid tokens.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lctrain.config import derive
from lctrain.config.cp_algorithms import algorithm_layouts, layout_overrides
from lctrain.config.derived import load_balance_of
from lctrain.data.batch import IGNORE_INDEX, MicroBatch, micro_batch_from_tokens
from lctrain.parallel.data_parallel import gradient_sync
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.planning.state import local_params
from lctrain.planning.traffic import dp_step_bytes, dp_step_traffic
from lctrain.training.loop import train
from lctrain.training.optim import build_optimizer, build_scheduler
from lctrain.training.step import forward_backward, train_step
from tests.helpers import on_ranks, reference_model, tiny_config


def _train(cfg, run_dir):
    return train(cfg, run_dir)


def _assert_same_history(got, ref, rtol=2e-5):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        for key in ("loss", "grad_norm", "lr", "valid_tokens"):
            assert g[key] == pytest.approx(r[key], rel=rtol), (key, g["step"], g[key], r[key])


def test_dp_layouts_and_accumulation_match_one_process(tmp_path):
    base = tiny_config(train={"steps": 4, "global_batch": 4, "micro_batch": 4})
    ref = on_ranks(_train, 1, base, str(tmp_path / "ref"))[0]
    assert ref[-1]["loss"] < ref[0]["loss"]
    layouts = {
        "accum_4x1": (1, {"micro_batch": 1}, "fsdp"),
        "dp2_fsdp": (2, {"micro_batch": 2}, "fsdp"),
        "dp2_accum2_ddp": (2, {"micro_batch": 1}, "ddp"),
        "dp4_fsdp": (4, {"micro_batch": 1}, "fsdp"),
    }
    for name, (nproc, train_over, engine) in layouts.items():
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, **train_over),
                                  parallel=dataclasses.replace(base.parallel, dp_engine=engine))
        histories = on_ranks(_train, nproc, cfg, str(tmp_path / name))
        for h in histories:  # every rank reports the same global metrics
            _assert_same_history(h, ref)


def _token_weighted_step(cfg, batches_per_rank):
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, cfg.train.steps)
    return train_step(model, opt, sched, batches_per_rank[rt.rank], cfg, rt)


def test_loss_is_token_weighted_across_ranks_and_micro_steps():
    cfg = tiny_config(train={"global_batch": 4, "micro_batch": 1}, optim={"grad_clip": 0.0})
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(1, cfg.model.vocab_size, (4, cfg.train.seq_len + 1), generator=gen)
    labels = seqs[:, 1:].clone()
    # very uneven valid-token counts: 3, 32, 10, 1
    for i, keep in enumerate((3, 32, 10, 1)):
        labels[i, keep:] = IGNORE_INDEX
    positions = torch.arange(cfg.train.seq_len)[None]
    mbs = [MicroBatch(seqs[i: i + 1, :-1], labels[i: i + 1], positions, None, positions)
           for i in range(4)]
    out = on_ranks(_token_weighted_step, 2, cfg, [mbs[:2], mbs[2:]])
    # reference: one process, mean over all valid tokens of the whole global batch
    model = reference_model(cfg)
    logits = model(seqs[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    for o in out:
        assert o["valid_tokens"] == 46
        assert o["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert o["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)


def test_bf16_autocast_trains(tmp_path):
    cfg = tiny_config(train={"dtype": "bf16", "steps": 3})
    fp32 = on_ranks(_train, 2, tiny_config(train={"steps": 3}), str(tmp_path / "a"))[0]
    bf16 = on_ranks(_train, 2, cfg, str(tmp_path / "b"))[0]
    for a, b in zip(fp32, bf16):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


CP_LAYOUTS = [  # (world, parallel overrides)
    # every registered algorithm on 2 and 4 ranks at each Ulysses degree the search tries
    # (Ulysses at 4: the 2 KV heads replicated x2), the contiguous split on 2, and DDP
    *((cp, {**layout_overrides(name, cp, u), "load_balance": "none" if cp == 2 else "auto"})
      for cp in (2, 4) for name, u in algorithm_layouts(cp)),
    (4, {"cp": 2, "dp": 2, "attention": "ring", "dp_engine": "ddp"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("document_masking", [False, True])
def test_context_parallel_training_matches_one_process(tmp_path, document_masking):
    data = {"document_masking": document_masking}
    base = tiny_config(train={"steps": 3, "global_batch": 2, "micro_batch": 2}, data=data)
    ref = on_ranks(_train, 1, base, str(tmp_path / "ref"))[0]
    layouts = [(w, par) for w, par in CP_LAYOUTS if w == 4 and par["cp"] == 4] \
        if document_masking else CP_LAYOUTS
    for i, (world, par) in enumerate(layouts):
        train_over = {"micro_batch": 1} if par.get("dp", 1) > 1 else {}
        cfg = tiny_config(train={"steps": 3, "global_batch": 2, "micro_batch": 2, **train_over},
                          parallel=par, data=data)
        for h in on_ranks(_train, world, cfg, str(tmp_path / str(i))):
            _assert_same_history(h, ref)


def _dp_traffic(cfg, accum):
    """Elements this rank's data-parallel engine sends in one optimizer step of `accum`
    micro-steps: FSDP2's all-gathers and reduce-scatters, or DDP's gradient all-reduces (counted
    in a comm hook)."""
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    sent = [0.0, 0.0]  # elements, bytes
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def count(elements: float, t: torch.Tensor) -> None:
        sent[0] += elements
        sent[1] += elements * t.element_size()

    def counted_gather(out, inp, group=None, **kw):
        count(inp.numel() * (dist.get_world_size(group) - 1), inp)
        return gather(out, inp, group=group, **kw)

    def counted_scatter(output, input, group=None, **kw):
        p = dist.get_world_size(group)
        count(input.numel() * (p - 1) / p, input)
        return scatter(output, input, group=group, **kw)

    def counted_all_reduce(group, bucket):
        p = dist.get_world_size(group)
        count(2 * bucket.buffer().numel() * (p - 1) / p, bucket.buffer())
        return allreduce_hook(group, bucket)

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(rt.dp_cp_group, counted_all_reduce)
    dist.all_gather_single, dist.reduce_scatter_single = counted_gather, counted_scatter
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(2):  # the first step initialises lazily; count the second
            sent[:] = [0.0, 0.0]
            for i in range(accum):
                x = torch.randint(1, cfg.model.vocab_size, (1, cfg.train.seq_len + 1),
                                  generator=gen)
                mb = micro_batch_from_tokens(x, cfg.train.seq_len, rt.axis_rank("cp"),
                                             cfg.parallel.cp, load_balance_of(cfg))
                with gradient_sync(model, sync=i == accum - 1):
                    forward_backward(model, mb, 1.0, rt)
            model.zero_grad(set_to_none=True)
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
    return sent


@pytest.mark.slow  # 3 s (the fast tier keeps tests/test_run_metrics.py's traffic checks)
def test_data_parallel_traffic_equals_the_plan():
    for world, par, accum, dtype in [(2, {"dp": 2}, 1, "fp32"), (2, {"dp": 2}, 2, "fp32"),
                                     (2, {"dp": 2}, 2, "bf16"),
                                     (2, {"dp": 2, "dp_engine": "ddp"}, 2, "fp32"),
                                     (2, {"dp": 2, "dp_engine": "ddp"}, 1, "bf16"),
                                     (4, {"dp": 2, "tp": 2, "sp": True}, 2, "fp32"),
                                     (2, {"cp": 2}, 1, "bf16")]:
        cfg = tiny_config(parallel=par, train={"micro_batch": 1, "dtype": dtype,
                                               "global_batch": accum * par.get("dp", 1)})
        d = derive(cfg, world)
        args = (cfg.parallel.dp_engine, *local_params(cfg), d.dp * cfg.parallel.cp, d.grad_accum)
        elements = dp_step_traffic(*args)
        nbytes = dp_step_bytes(*args, 2 if dtype == "bf16" else 4)
        assert d.grad_accum == accum
        for got in on_ranks(_dp_traffic, world, cfg, accum):
            assert got == [elements, nbytes], (par, accum, dtype, got, elements, nbytes)
