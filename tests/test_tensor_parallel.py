"""Megatron TP + SP (DTensor plan) against the single-process model, composed with cp and dp;
and the collectives a block issues, against the Megatron SP formula (docs/parallelism.md §2).
The block's collectives on 2 ranks are the fast tier's TP case; the layouts are slow."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from lctrain.comm import record_dtensor_traffic
from lctrain.config import ModelConfig
from lctrain.config.derived import load_balance_of
from lctrain.data.batch import micro_batch_from_tokens
from lctrain.models.blocks import Block
from lctrain.models.registry import family_code
from lctrain.models.rope import RotaryEmbedding
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.parallel.tensor import tp_plan
from lctrain.training.loop import train
from lctrain.training.step import forward_backward
from tests.helpers import HEADS_8, on_ranks, reference_model, tiny_config, train_on_ranks

MODEL = HEADS_8
LAYOUTS = [  # (world, parallel overrides)
    (2, {"tp": 2}),
    (2, {"tp": 2, "sp": True}),
    (4, {"tp": 4, "sp": True}),
    (4, {"tp": 4}),
    (4, {"tp": 2, "sp": True, "cp": 2, "attention": "ring"}),
    (4, {"tp": 2, "sp": True, "dp": 2}),
    (8, {"tp": 2, "sp": True, "cp": 2, "dp": 2, "attention": "usp", "ulysses_degree": 2}),
    (8, {"tp": 4, "sp": True, "cp": 2, "attention": "ulysses"}),  # KV replicated x2
]


def _train(cfg, run_dir):
    return train(cfg, run_dir)


@pytest.mark.slow  # 17-27 s on 2 cores: 8 layouts of 2 to 8 ranks
def test_tp_sp_layouts_match_one_process(tmp_path):
    steps = {"steps": 5, "global_batch": 2, "micro_batch": 2, "seq_len": 32}
    runs = {"ref": (1, tiny_config(model=MODEL, train=steps))}
    for i, (world, par) in enumerate(LAYOUTS):
        train_over = {**steps, "micro_batch": 1} if par.get("dp", 1) > 1 else steps
        runs[str(i)] = (world, tiny_config(model=MODEL, train=train_over, parallel=par))
    histories = train_on_ranks(runs, str(tmp_path))  # one spawn per world size
    ref = histories["ref"][0]
    for i, (_, par) in enumerate(LAYOUTS):
        for h in histories[str(i)]:
            assert len(h) == len(ref)
            for g, r in zip(h, ref):
                for key in ("loss", "grad_norm"):
                    assert g[key] == pytest.approx(r[key], rel=2e-5), (par, g["step"], key)


def _block_traffic(sp: bool):
    tp, b, s = 2, 2, 24
    mesh = init_device_mesh("cpu", (tp,))
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
    block = Block(cfg)
    parallelize_module(block, mesh, tp_plan(sp, family_code(cfg))[1])
    x = torch.randn(b, s // tp if sp else s, cfg.dim)
    cos, sin = RotaryEmbedding(cfg)(
        torch.arange(s)[None], torch.float32)
    with record_dtensor_traffic() as fwd:
        y = block(x, cos=cos, sin=sin)
    with record_dtensor_traffic() as bwd:
        y.sum().backward()
    return ({op for _, op in fwd.elements}, fwd.total(), {op for _, op in bwd.elements},
            bwd.total(), sum(fwd.bytes.values()), sum(bwd.bytes.values()))


@pytest.mark.parametrize("sp", [True, False])
def test_block_collectives_match_megatron_sp(sp):
    fwd_ops, fwd, bwd_ops, bwd, fwd_bytes, bwd_bytes = on_ranks(_block_traffic, 2, sp)[0]
    # per block and direction: 2 all-gathers + 2 reduce-scatters of [B, S, D] with SP, or
    # 2 all-reduces without (all-reduce = reduce-scatter + all-gather): 4 (t-1)/t B S D each
    formula = 4 * (2 - 1) / 2 * 2 * 24 * 32
    expected_ops = {"all_gather", "reduce_scatter"} if sp else {"all_reduce"}
    assert fwd_ops == expected_ops and bwd_ops == expected_ops
    assert fwd == formula and bwd == formula
    assert fwd_bytes == bwd_bytes == 4 * formula  # float32


AC_LAYOUTS = [(1, {}, "selective"), (1, {}, "full"),
              (4, {"tp": 2, "sp": True, "cp": 2, "attention": "ring"}, "selective"),
              (4, {"tp": 2, "sp": True, "cp": 2, "attention": "ring"}, "full"),
              (2, {"cp": 2, "attention": "ulysses"}, "selective")]


@pytest.mark.slow  # 4-12 s on 2 cores: 5 layouts of 1 to 4 ranks
def test_activation_checkpointing_changes_nothing_but_memory(tmp_path):
    steps = {"steps": 3, "global_batch": 2, "micro_batch": 2, "seq_len": 32}
    runs = {"ref": (1, tiny_config(model=MODEL, train=steps))}
    for i, (world, par, mode) in enumerate(AC_LAYOUTS):
        runs[str(i)] = (world, tiny_config(model=MODEL, parallel=par,
                                           train={**steps, "activation_checkpointing": mode}))
    histories = train_on_ranks(runs, str(tmp_path))  # one spawn per world size
    ref = histories["ref"][0]
    for i, (_, par, mode) in enumerate(AC_LAYOUTS):
        for h in histories[str(i)]:
            for g, r in zip(h, ref):
                for key in ("loss", "grad_norm"):
                    assert g[key] == pytest.approx(r[key], rel=2e-5), (par, mode, key)


def _grads_after_one_backward(cfg, seqs):
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    dp, dp_rank = rt.topology.dp, rt.topology.axis_rank(rt.rank, "dp")
    mine = seqs.chunk(dp)[dp_rank]  # this dp rank's sequences
    scale = rt.topology.group_size("dp_cp") / seqs[:, 1:].numel()
    mb = micro_batch_from_tokens(mine, cfg.train.seq_len, rt.topology.axis_rank(rt.rank, "cp"),
                                 cfg.parallel.cp, load_balance_of(cfg))
    forward_backward(model, mb, scale, rt)
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in model.named_parameters()}


GRAD_LAYOUTS = [(2, {"tp": 2, "sp": True}), (4, {"tp": 4}),
                (8, {"tp": 2, "sp": True, "cp": 2, "dp": 2, "attention": "ring"})]


@pytest.mark.slow  # 3-10 s on 2 cores: 2, 4 and 8 ranks
def test_every_gradient_matches_one_process():
    import torch.nn.functional as F

    seqs = torch.randint(1, 128, (2, 33), generator=torch.Generator().manual_seed(3))
    ref_cfg = tiny_config(model=MODEL)
    ref = reference_model(ref_cfg)
    logits = ref(seqs[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten()).backward()
    for world, par in GRAD_LAYOUTS:
        cfg = tiny_config(model=MODEL, parallel=par,
                          train={"global_batch": 2, "micro_batch": 2 // par.get("dp", 1)})
        grads = on_ranks(_grads_after_one_backward, world, cfg, seqs, timeout_s=300)[0]
        assert grads.keys() == dict(ref.named_parameters()).keys()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{par} {name}")


TIED = {**MODEL, "tie_embeddings": True}


def _grads_then_train(grad_cfg, seqs, cfg, run_dir):
    """One backward's gradients, then a training run, on the same ranks."""
    return _grads_after_one_backward(grad_cfg, seqs), train(cfg, run_dir)


@pytest.mark.slow  # 3-6 s on 2 cores: 3 spawns of 1 to 4 ranks
def test_tied_embeddings_under_tp_match_one_process(tmp_path):
    """The vocab-parallel embedding and output layer share one [V/tp, D] shard: every gradient
    after one backward, and the losses and grad norms of 3 steps, equal one process."""
    import torch.nn.functional as F

    seqs = torch.randint(1, 128, (2, 33), generator=torch.Generator().manual_seed(3))
    ref = reference_model(tiny_config(model=TIED))
    F.cross_entropy(ref(seqs[:, :-1]).flatten(0, 1), seqs[:, 1:].flatten()).backward()
    steps = {"steps": 3, "global_batch": 2, "micro_batch": 2, "seq_len": 32}
    ref_history = on_ranks(_train, 1, tiny_config(model=TIED, train=steps), str(tmp_path / "r"))[0]
    for world, par in [(2, {"tp": 2}), (4, {"tp": 2, "sp": True, "cp": 2, "attention": "ring"})]:
        grad_cfg = tiny_config(model=TIED, parallel=par,
                               train={"global_batch": 2, "micro_batch": 2})
        cfg = tiny_config(model=TIED, parallel=par, train=steps)
        results = on_ranks(_grads_then_train, world, grad_cfg, seqs, cfg,
                           str(tmp_path / str(world)), timeout_s=300)
        grads = results[0][0]
        assert "output.weight" not in grads  # one parameter, shared
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{par} {name}")
        for _, h in results:
            for g, r in zip(h, ref_history):
                for key in ("loss", "grad_norm"):
                    assert g[key] == pytest.approx(r[key], rel=2e-5), (par, g["step"], key)
