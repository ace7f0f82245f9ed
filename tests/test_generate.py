"""Greedy generation on the training layout (lctrain.training.generate) against transformers'
`generate` (fp32, the same prompts, stopping at the end-of-text token): random models of the
families with windows, sinks and experts, at one rank, cp2 ring with the documents split, cp2
Ulysses and tp2 x cp2 ring; the prompt crosses the cp ranks and the new tokens' keys go to
each rank's cache in turn."""

from __future__ import annotations

import pytest
import torch

from lctrain.config.compose import compose
from lctrain.prepare.init_from import resolve_model
from tests.helpers import on_ranks
from tests.test_model_families import RUN, save_family

FAMILIES = ("llama", "gemma3_text", "gpt_oss", "qwen3_moe")
"""Plain attention; window layers (their own RoPE base, sandwich norms); sinks and windows with
experts; experts with a dense layer."""
LAYOUTS = {
    "cp1": ["parallel.cp=1", "parallel.dp=4"],
    "cp2_ring_documents": ["parallel.cp=2", "parallel.dp=2", "parallel.attention=ring",
                           "data.document_masking=true"],
    "cp2_ulysses": ["parallel.cp=2", "parallel.dp=2", "parallel.attention=ulysses",
                    "data.document_masking=false"],
    "tp2_cp2_ring": ["parallel.cp=2", "parallel.dp=1", "parallel.tp=2", "parallel.sp=false",
                     "parallel.attention=ring", "data.document_masking=false"],
}
NEW_TOKENS = 6


def _generate_each(cfgs: dict, prompts: torch.Tensor, stops: dict) -> dict:
    from lctrain.parallel.parallelize import build_model
    from lctrain.parallel.runtime import setup_distributed
    from lctrain.training.generate import generate

    out = {}
    for key, cfg in cfgs.items():
        rt = setup_distributed(cfg)
        model = build_model(cfg, rt)
        model.eval()
        out[key] = generate(model, cfg, rt, prompts, NEW_TOKENS, stops[key[0]])
    return out


@pytest.mark.slow  # 4 families x 4 layouts on 4 ranks, and transformers' generate
def test_greedy_tokens_are_transformers_generate(tmp_path):
    torch.manual_seed(0)
    prompts = torch.randint(3, 128, (2, 21))
    cfgs, wants, stops = {}, {}, {}
    for family in FAMILIES:
        hf = save_family(tmp_path / family, family)
        eos = hf.generation_config.eos_token_id
        stops[family] = eos[0] if isinstance(eos, list) else eos
        # transformers stops a row at its end-of-text token and pads it with pad_token_id
        wants[family] = hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                    max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=stops[family])[:, prompts.shape[1]:]
        for layout, overrides in LAYOUTS.items():
            cfgs[family, layout] = resolve_model(compose(
                [*RUN, f"model.init_from={tmp_path / family}", *overrides])).cfg
    per_rank = on_ranks(_generate_each, 4, cfgs, prompts, stops, timeout_s=300)
    for key in cfgs:
        for rank in per_rank:
            assert rank[key].tolist() == wants[key[0]].tolist(), (key, rank[key], wants[key[0]])


def test_what_generation_does_not_run_is_refused_by_name():
    from lctrain.config.eval_rules import generation_problems
    from tests.helpers import tiny_config

    assert generation_problems(tiny_config(parallel={"tp": 2, "sp": False})) == []
    problems = generation_problems(tiny_config(
        parallel={"tp": 2, "sp": True, "pp": 2},
        model={"family": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"],
               "linear_key_heads": 2, "linear_value_heads": 4}))
    assert [p.split(":")[0] for p in problems] == [
        "parallel.tp=2 with parallel.sp=true", "parallel.pp=2",
        "linear_attention layers (model.layer_types)"]
