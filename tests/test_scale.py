"""Scale per device: meta-device init (the same global weights at any layout; no rank holds more
than its shard and one layer), and each memory feature (tiled loss, tiled MLP, activation
offload, compile) against the plain path: losses, grad norms and every gradient."""

import pytest
import torch

from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.tracing.measure import measure_peak
from tests.helpers import HEADS_8, on_ranks, reference_model, tiny_config, train_each

MODEL = HEADS_8
LAYOUTS = [(1, {}), (2, {"tp": 2}), (4, {"tp": 2, "sp": True, "cp": 2}), (2, {"dp": 2}),
           (2, {"dp": 2, "dp_engine": "ddp"}), (4, {"tp": 2, "dp": 2}),
           (4, {"cp": 2, "dp": 2, "attention": "ulysses"})]


def _full_weights(cfg):
    model = build_model(cfg, setup_distributed(cfg))
    module = model.module if hasattr(model, "module") else model
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in module.named_parameters()}


def _full_weights_each(cfgs):
    return [_full_weights(cfg) for cfg in cfgs]


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_meta_init_gives_the_same_global_weights_at_every_layout(tied):
    for world in dict.fromkeys(world for world, _ in LAYOUTS):  # one spawn per world size
        pars = [par for w, par in LAYOUTS if w == world]
        cfgs = [tiny_config(model={**MODEL, "tie_embeddings": tied}, parallel=par,
                            train={"global_batch": 4, "micro_batch": 1}) for par in pars]
        for per_layout in on_ranks(_full_weights_each, world, cfgs):
            for par, cfg, weights in zip(pars, cfgs, per_layout, strict=True):
                reference = dict(reference_model(cfg).named_parameters())
                assert weights.keys() == reference.keys()
                for name, want in reference.items():
                    assert torch.equal(weights[name], want), (par, name)  # bit for bit


def _build_and_measure(cfg):
    rt = setup_distributed(cfg)
    built = []
    peak = measure_peak(lambda: built.append(build_model(cfg, rt)))
    model = built[0]
    shard = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    layer = sum(p.numel() * 4 for p in model.layers["0"].parameters())  # global fp32 sizes
    total = sum(p.numel() * 4 for p in model.parameters())
    return peak, shard, layer, total


def test_a_model_larger_than_a_rank_may_hold_builds_sharded_at_dp4():
    cfg = tiny_config(model={"vocab_size": 8192, "dim": 512, "n_layers": 8, "n_heads": 8,
                             "n_kv_heads": 2, "ffn_dim": 1536},
                      parallel={"dp": 4}, train={"global_batch": 4, "micro_batch": 1})
    cap = 64 * 2**20  # what one rank may use
    for peak, shard, layer, total in on_ranks(_build_and_measure, 4, cfg, timeout_s=300):
        assert total > cap  # the full fp32 model would not fit one rank
        assert shard <= total / 4 + 4 * 2**20  # a quarter, plus FSDP's padding
        assert peak <= shard + layer, (peak, shard, layer)  # its shard plus at most one layer
        assert peak <= cap


FEATURES = {"loss_chunk": {"loss_chunk": 6}, "mlp_chunk": {"mlp_chunk": 4},
            "both": {"loss_chunk": 10, "mlp_chunk": 6},
            "offload": {"activation_checkpointing": "full", "offload_activations": True}}
PARITY_LAYOUTS = [(1, {}), (4, {"tp": 2, "sp": True, "cp": 2, "attention": "ring"}),
                  (4, {"dp": 2, "cp": 2, "attention": "ring"})]


def _grads_plain_and_tiled(cfgs, seqs):
    from tests.test_tensor_parallel import _grads_after_one_backward

    return [_grads_after_one_backward(cfg, seqs) for cfg in cfgs]


@pytest.mark.parametrize("world,par", [  # slow: tp2 x sp x cp2, 5 s on 2 cores
    PARITY_LAYOUTS[0], pytest.param(*PARITY_LAYOUTS[1], marks=pytest.mark.slow),
    PARITY_LAYOUTS[2]], ids=["1", "tp2sp_cp2", "dp2_cp2"])
def test_each_memory_feature_gives_the_plain_gradients(world, par):
    seqs = torch.randint(1, 128, (2, 33), generator=torch.Generator().manual_seed(3))
    train = {"global_batch": 2, "micro_batch": 2 // par.get("dp", 1)}
    cfgs = [tiny_config(model=MODEL, parallel=par, train=train)]
    cfgs += [tiny_config(model=MODEL, parallel=par, train={**train, **f})
             for f in FEATURES.values()]
    plain, *tiled = on_ranks(_grads_plain_and_tiled, world, cfgs, seqs, timeout_s=300)[0]
    for name, grads in zip(FEATURES, tiled):
        for param, want in plain.items():
            torch.testing.assert_close(grads[param], want, rtol=1e-5, atol=1e-7,
                                       msg=f"{par} {name} {param}")


def _history(cfg, run_dir):
    from lctrain.training.loop import train

    return train(cfg, run_dir)


@pytest.mark.slow  # 3-5 s on 2 cores: 4 ranks
def test_tiled_training_matches_the_plain_losses(tmp_path):
    steps = {"steps": 3, "global_batch": 2, "micro_batch": 1}
    par = {"tp": 2, "sp": True, "cp": 2, "attention": "ring"}
    plain = on_ranks(_history, 1, tiny_config(model=MODEL, train={**steps, "micro_batch": 2}),
                     str(tmp_path / "ref"))[0]
    cfg = tiny_config(model=MODEL, parallel=par,
                      train={**steps, "micro_batch": 2, **FEATURES["both"],
                             "activation_checkpointing": "full"})
    for history in on_ranks(_history, 4, cfg, str(tmp_path / "tiled"), timeout_s=300):
        for got, want in zip(history, plain):
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=2e-5), (got["step"], key)


def test_offload_keeps_the_block_inputs_in_host_memory(monkeypatch):
    """With full checkpointing, what autograd saves outside the blocks is packed into host
    copies, the block inputs among them ([B, S, D], one per layer)."""
    packed = []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook

            def counted(tensor):
                packed.append(tuple(tensor.shape))
                return pack(tensor)
            self.pack_hook = counted

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    from tests.test_tensor_parallel import _grads_after_one_backward

    seqs = torch.randint(1, 128, (2, 33), generator=torch.Generator().manual_seed(3))
    cfg = tiny_config(model=MODEL, train={"global_batch": 2, "micro_batch": 2,
                                          "activation_checkpointing": "full",
                                          "offload_activations": True})
    _grads_after_one_backward(cfg, seqs)
    assert packed.count((2, 32, MODEL["dim"])) >= MODEL["n_layers"], packed


HYBRID = {"family": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"],
          "linear_key_heads": 2, "linear_value_heads": 4, "linear_key_dim": 8,
          "linear_value_dim": 16}
"""A Qwen3.5-shaped hybrid: a Gated DeltaNet layer and a gated full-attention one."""


@pytest.mark.slow  # 30 s on 2 cores, most of it torch.compile
def test_compiled_blocks_and_loss_match_eager(tmp_path):
    """A dense model and a hybrid (its linear layer's convolution and chunked rule compiled
    too)."""
    steps = {"steps": 2, "global_batch": 2, "micro_batch": 2}
    runs = {}
    for name, model in (("dense", MODEL), ("hybrid", HYBRID)):
        runs[f"{name}_eager"] = tiny_config(model=model, train=steps)
        runs[f"{name}_compiled"] = tiny_config(model=model, train={**steps, "compile": True,
                                                                    "loss_chunk": 16})
    histories = on_ranks(train_each, 1, runs, str(tmp_path), timeout_s=600)[0]
    for name in ("dense", "hybrid"):
        for got, want in zip(histories[f"{name}_compiled"], histories[f"{name}_eager"]):
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (name, got["step"], key)
