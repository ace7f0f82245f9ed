"""Synthetic data and sampler (no processes), schedule and parameter groups."""

import math

import pytest
import torch

from lctrain.config import DataConfig, OptimConfig
from lctrain.data import EOS, DataParallelSampler, SyntheticLM
from lctrain.model import Llama
from lctrain.optim import build_optimizer, lr_at
from tests.helpers import tiny_config


def dataset(seq_len=64, seed=0):
    return SyntheticLM(DataConfig(doc_len_min=8, doc_len_max=20), 100, seq_len, seed)


def test_samples_are_deterministic_and_structured():
    ds = dataset()
    a, b = ds.sample(7), ds.sample(7)
    assert torch.equal(a, b) and a.shape == (65,) and a.dtype == torch.int64
    assert not torch.equal(a, ds.sample(8))
    assert not torch.equal(a, dataset(seed=1).sample(7))
    assert int(a.min()) >= 0 and int(a.max()) < 100 and (a == EOS).any()
    # every transition inside a walk follows the hidden chain
    seq = a.tolist()
    doc = seq[: seq.index(EOS)]
    half = len(doc) // 2
    for x, y in zip(doc[: half - 1], doc[1:half]):
        assert y in ds.successors[x]
    assert doc[half:] == doc[: len(doc) - half]  # second half repeats the first


@pytest.mark.parametrize("dp,micro", [(1, 8), (2, 2), (4, 1), (8, 1)])
def test_every_split_covers_the_same_global_batch(dp, micro):
    ds = dataset()
    accum = 8 // (dp * micro)
    seen = []
    for rank in range(dp):
        sampler = DataParallelSampler(ds, rank, dp, micro, accum)
        for step in range(3):
            seen += [(step, i) for mb in sampler.indices(step) for i in mb]
    assert sorted(seen) == [(s, i) for s in range(3) for i in range(8 * s, 8 * s + 8)]


def test_sampler_resumes_exactly():
    ds = dataset()
    run = DataParallelSampler(ds, 1, 2, 2, 2)
    for _ in range(3):
        run.next_step()
    state = run.state_dict()
    expected = run.next_step()
    resumed = DataParallelSampler(ds, 1, 2, 2, 2)
    resumed.load_state_dict(state)
    got = resumed.next_step()
    for e, g in zip(expected, got):
        assert torch.equal(e.inputs, g.inputs) and torch.equal(e.labels, g.labels)
        assert torch.equal(g.inputs[:, 1:], g.labels[:, :-1])  # labels are shifted inputs


def test_warmup_cosine_schedule():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    assert [lr_at(s, cfg, 104) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(54, cfg, 104) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert lr_at(104, cfg, 104) == pytest.approx(0.1)
    assert lr_at(500, cfg, 104) == pytest.approx(0.1)
    cfg.schedule = "constant"
    assert lr_at(50, cfg, 104) == 1.0


def test_no_weight_decay_on_norms_and_embeddings():
    cfg = tiny_config()
    model = Llama(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == cfg.optim.weight_decay and no_decay["weight_decay"] == 0
    assert all("norm" not in names[id(p)] and "tok_embeddings" not in names[id(p)]
               for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"tok_embeddings.weight", "norm.weight",
                                                           "layers.0.attention_norm.weight"}
    assert "output.weight" in {names[id(p)] for p in decay["params"]}
