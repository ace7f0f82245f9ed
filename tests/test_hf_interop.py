"""Hugging Face interop: a transformers LlamaForCausalLM saved to disk loads into lctrain at
tp=2 x cp=2 (untied; each rank reading its slices) and cp=2 x dp=2 (tied) with the same logits,
and the exported directory loads back into transformers with the same logits again; sharded
directories (several safetensors files and their index) both ways."""

import json

import pytest
import torch
import transformers

from lctrain.comm import all_gather
from lctrain.layout import sequence
from lctrain.models.hf import check_hf_dir, export_hf, full_parameters, hf_config
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from tests.helpers import on_ranks, tiny_config

MODEL = {"vocab_size": 128, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 96, "rope_theta": 50000.0}


def _load_forward_export(cfg, tokens, out_dir, shard_bytes):
    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)  # TP, FSDP over dp x cp, then each rank loads its slices
    cp_rank = rt.topology.axis_rank(rt.rank, "cp")
    positions = sequence.positions(tokens.shape[1], cp_rank, 2, "zigzag")[None]
    with torch.no_grad():
        local = model(sequence.split(tokens, 1, cp_rank, 2, "zigzag"), positions=positions)
    local = local.full_tensor() if hasattr(local, "full_tensor") else local
    parts = all_gather(local, rt.mesh.group("cp"), dim=0).chunk(2, dim=0)  # cp-rank order
    export_hf(full_parameters(model), cfg.model, out_dir, rt.rank, shard_bytes)
    return sequence.merge(list(parts), 1, "zigzag")


@pytest.mark.parametrize("tied,parallel,sharded", [
    (False, {"tp": 2, "sp": True, "cp": 2, "attention": "ring"}, False),
    (True, {"cp": 2, "dp": 2, "attention": "ulysses"}, True),
    (True, {"tp": 2, "sp": True, "cp": 2, "attention": "ring"}, False),  # one vocab-sharded weight
])
def test_hf_round_trip(tmp_path, tied, parallel, sharded):
    cfg = tiny_config(model={**MODEL, "tie_embeddings": tied}, parallel=parallel)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config(cfg.model)).eval()
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB" if sharded else "5GB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1 or not sharded
    cfg.model.init_from = str(tmp_path / "hf")
    assert check_hf_dir(cfg.model.init_from, cfg.model) == []
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
    world = parallel.get("tp", 1) * parallel["cp"] * parallel.get("dp", 1)
    shard_bytes = 40_000 if sharded else 2**30
    got = on_ranks(_load_forward_export, world, cfg, tokens, str(tmp_path / "out"), shard_bytes)
    for logits in got:
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    if sharded:  # numbered files, each at most one tensor past the limit, and their index
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
        assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    else:
        assert files == ["model.safetensors"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    back.config._attn_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=tokens).logits, ref, rtol=1e-5, atol=1e-5)


def test_init_from_errors(tmp_path):
    cfg = tiny_config(model=MODEL).model
    assert "has no config.json" in check_hf_dir(str(tmp_path), cfg)[0]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "model_type='gemma2'" in check_hf_dir(str(tmp_path), cfg)[0]
    shape = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4,
             "vocab_size": 128, "num_hidden_layers": 2, "intermediate_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    problems = check_hf_dir(str(tmp_path), cfg)
    assert problems == [f"model.init_from: hidden_size=128 in {tmp_path / 'config.json'} but "
                        "model.dim=64; set model.dim=128",
                        f"model.init_from: num_key_value_heads=4 in {tmp_path / 'config.json'} "
                        "but model.n_kv_heads=2; set model.n_kv_heads=4"]
