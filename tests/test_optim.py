"""Schedule and parameter groups (no processes)."""

import math

import pytest

from lctrain.config import OptimConfig
from lctrain.models.registry import new_model
from lctrain.training.optim import build_optimizer, lr_at
from tests.helpers import tiny_config


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
    model = new_model(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == cfg.optim.weight_decay and no_decay["weight_decay"] == 0
    assert all("norm" not in names[id(p)] and "tok_embeddings" not in names[id(p)]
               for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"tok_embeddings.weight", "norm.weight",
                                                           "layers.0.attention_norm.weight"}
    assert "output.weight" in {names[id(p)] for p in decay["params"]}
