"""A family's features are parts of a composed block: a toy family with a part no family has
(tests/toy_family.py), registered for the length of a test in the four registries a new family
with a new part adds to, builds, counts its parameters as the planner does, maps its Hugging Face
names, computes what an independent reference computes, and trains on the layouts as one rank
does."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import numpy as np
import pytest
import torch

from lctrain.config.model_families import MODEL_FAMILIES, model_family
from lctrain.config.model_parts import MODEL_PARTS
from lctrain.config.model_size import param_count
from lctrain.data.batch import micro_batch_from_tokens
from lctrain.models.hf import from_hf_state_dict, to_hf_state_dict
from lctrain.models.parts import PARTS, parts_of
from lctrain.models.registry import new_model
from tests import toy_family
from tests.helpers import HEADS_8, tiny_config, train_on_ranks

TOY = {**HEADS_8, "family": toy_family.TOY.name}


@contextlib.contextmanager
def toy_registered():
    """The toy family and its part in the registries, for the block."""
    with (MODEL_PARTS.registered(toy_family.VALUE_SCALE),
          PARTS.registered(toy_family.ValueScale(toy_family.VALUE_SCALE.name)),
          MODEL_FAMILIES.registered(toy_family.TOY)):
        yield


def test_every_part_has_its_code_and_every_family_registered_parts():
    assert list(PARTS) == list(MODEL_PARTS)
    for name in MODEL_FAMILIES:
        family = model_family(name)
        assert all(MODEL_PARTS[part.name] is part for part in family.parts), name
        assert [p.name for p in parts_of(family)] == [p.name for p in family.parts]


def test_a_family_with_a_new_part_is_four_registrations():
    """Where the toy's entries go: 3 registries in 3 files of lctrain/, and the family's
    module (docs/extending.md: at most 5 files with a preset's config.json keys)."""
    homes = {"lctrain.config.model_parts": ("MODEL_PARTS", MODEL_PARTS),
             "lctrain.models.parts": ("PARTS", PARTS),
             "lctrain.config.model_families": ("MODEL_FAMILIES", MODEL_FAMILIES)}
    for module, (name, registry) in homes.items():
        assert vars(importlib.import_module(module))[name] is registry
    assert len({*homes, toy_family.TOY.module}) == 4


def _folded_reference(toy: torch.nn.Module, cfg) -> torch.nn.Module:
    """Llama with the toy's weights and no scale: scaling each value dimension by w scales the
    attention's output by w (a weighted mean of values), which the output projection's columns
    take instead."""
    ref = new_model(dataclasses.replace(cfg, family="llama")).double()
    state = {k: v for k, v in toy.state_dict().items() if "v_scale" not in k}
    for i, layer in toy.layers.items():
        w = layer.attention.v_scale.weight.detach()
        state[f"layers.{i}.attention.wo.weight"] = (
            layer.attention.wo.weight.detach() * w.repeat(cfg.n_heads))
    ref.load_state_dict(state)
    return ref


def test_the_toy_family_builds_counts_maps_and_computes_as_its_reference():
    cfg = tiny_config(model=TOY, train={"seq_len": 24})
    with toy_registered():
        assert "a scale on each value dimension" in model_family(TOY["family"]).summary
        toy = new_model(cfg.model).double()
        toy.init_weights(0)
        assert param_count(cfg.model) == sum(p.numel() for p in toy.parameters())
        with torch.no_grad():  # away from their initial ones
            for layer in toy.layers.values():
                layer.attention.v_scale.weight.uniform_(0.5, 1.5)
        hf = to_hf_state_dict(toy.state_dict(), toy.cfg)
        assert "model.layers.1.self_attn.v_scale.weight" in hf
        assert from_hf_state_dict(hf, toy.cfg).keys() == toy.state_dict().keys()
        ref = _folded_reference(toy, cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 25))
    lengths = [np.array([7, 12, 6]), np.array([25])]  # packed documents of mixed lengths
    batch = micro_batch_from_tokens(tokens, 24, lengths=lengths, document_masking=True)
    inputs = {"positions": batch.positions, "doc_ids": batch.doc_ids, "labels": batch.labels}
    got, want = toy(batch.inputs, **inputs), ref(batch.inputs, **inputs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    got.backward()
    want.backward()
    for name, p in ref.named_parameters():  # but the output projections, scaled apart
        if "wo" not in name:
            torch.testing.assert_close(dict(toy.named_parameters())[name].grad, p.grad,
                                       rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.slow  # 9 s on 2 cores: 2 runs on 2 ranks
def test_the_toy_family_trains_on_the_layouts_as_one_rank(tmp_path):
    steps = {"steps": 3, "global_batch": 2, "micro_batch": 2, "seq_len": 32}
    layouts = {"cp2_ring_documents": {"cp": 2, "attention": "ring",
                                      "load_balance": "documents"},
               "tp2_sp": {"tp": 2, "sp": True}}
    data = {"document_masking": True}
    runs = {"one": (1, tiny_config(model=TOY, train=steps, data=data))}
    runs.update({name: (2, tiny_config(model=TOY, train=steps, data=data, parallel=par))
                 for name, par in layouts.items()})
    with toy_registered():  # the ranks fork inside: they see the toy's entries
        histories = train_on_ranks(runs, str(tmp_path))
    ref = histories["one"][0]
    for name in layouts:
        for history in histories[name]:
            for got, want in zip(history, ref, strict=True):
                for key in ("loss", "grad_norm"):
                    assert got[key] == pytest.approx(want[key], rel=2e-5), (name, key)
