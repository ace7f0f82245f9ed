"""lctrain's Llama against Hugging Face LlamaForCausalLM: same config, same weights.

Logits and every parameter gradient must agree (fp32), for GQA/MHA/MQA, tied and untied
embeddings, and positions given explicitly.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers

from lctrain.config import ModelConfig
from lctrain.models.hf import from_hf_state_dict, hf_config, to_hf_name, to_hf_state_dict
from lctrain.models.registry import new_model


def build_pair(cfg: ModelConfig, seed: int = 0):
    ours = new_model(cfg)
    ours.init_weights(seed)
    hf = transformers.LlamaForCausalLM(hf_config(cfg))
    hf.config._attn_implementation = "eager"  # independent attention code path
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg),
                                             strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"} and (not missing or cfg.tie_embeddings)
    return ours, hf


CASES = {
    "gqa_untied": ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2,
                              ffn_dim=80, rope_theta=500000.0),
    "mha_tied": ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=4,
                            ffn_dim=64, tie_embeddings=True),
    "mqa_head_dim_24": ModelConfig(vocab_size=50, dim=120, n_layers=1, n_heads=5, n_kv_heads=1,
                                   ffn_dim=96, norm_eps=1e-6),
}


ROPE = {  # context-extension settings; HF applies them from config.rope_parameters
    "llama3": dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                   rope_high_freq_factor=4.0, rope_original_max_position=64,
                   rope_theta=500000.0),
    "linear": dict(rope_type="linear", rope_factor=4.0),
    "yarn": dict(rope_type="yarn", rope_factor=16.0, rope_original_max_position=32,
                 rope_beta_fast=32.0, rope_beta_slow=1.0),
}
for _name, _rope in ROPE.items():
    CASES[f"rope_{_name}"] = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=2,
                                         n_kv_heads=1, ffn_dim=64, **_rope)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_grads_match_transformers(name):
    cfg = CASES[name]
    ours, hf = build_pair(cfg)
    # 300 positions: past rope_original_max_position, where the scaled frequencies matter
    tokens = torch.randint(0, cfg.vocab_size, (2, 300 if name.startswith("rope") else 37),
                           generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    logits = ours(tokens)
    ref = hf(input_ids=tokens).logits
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(ref.flatten(0, 1), labels.flatten()).backward()
    hf_params = dict(hf.named_parameters())
    for n, p in ours.named_parameters():
        ref_grad = hf_params[to_hf_name(n, cfg.family)].grad
        torch.testing.assert_close(p.grad, ref_grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", sorted(ROPE))
def test_rope_scaling_changes_the_frequencies(name):
    from lctrain.models.rope import rope_frequencies

    cfg = CASES[f"rope_{name}"]
    plain = ModelConfig(**{**cfg.__dict__, "rope_type": "default"})
    assert not torch.allclose(rope_frequencies(cfg)[0], rope_frequencies(plain)[0])


def test_explicit_positions_match_transformers():
    cfg = CASES["gqa_untied"]
    ours, hf = build_pair(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    positions = torch.arange(100, 116)[None]  # e.g. a later shard of a long sequence
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, positions=positions),
                                   hf(input_ids=tokens, position_ids=positions).logits,
                                   rtol=1e-5, atol=1e-5)


def test_state_dict_round_trip_and_deterministic_init():
    cfg = CASES["gqa_untied"]
    a, b = new_model(cfg), new_model(cfg)
    a.init_weights(3)
    b.init_weights(3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    back = from_hf_state_dict(to_hf_state_dict(a.state_dict(), a.cfg), a.cfg)
    assert back.keys() == a.state_dict().keys()
    c = new_model(cfg)
    c.init_weights(4)
    assert not torch.equal(c.layers["0"].attention.wq.weight, a.layers["0"].attention.wq.weight)


def test_missing_embedding_and_head_for_pipeline_stages():
    cfg = CASES["gqa_untied"]
    full = new_model(cfg)
    full.init_weights(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, 8))
    first, last = new_model(cfg), new_model(cfg)
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), full(tokens))
    assert "layers.1.attention.wq.weight" in last.state_dict()  # keys never renamed


@pytest.mark.parametrize("offset", [False, True], ids=["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_tile_by_tile_is_transformers_norm(monkeypatch, offset, dtype):
    """lctrain's RMSNorm works on row tiles (its float32 working tensors a tile each): the
    output equals transformers' norm bit for bit, and the gradients equal autograd's through
    transformers' norm, with tiles of 3 rows over 2 x 7 rows and with one tile."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    import lctrain.models.norms as norms

    dim = 16
    torch.manual_seed(0)
    theirs = (Gemma3RMSNorm if offset else LlamaRMSNorm)(dim, eps=1e-5).to(dtype)
    with torch.no_grad():
        theirs.weight.add_(torch.randn(dim) * 0.3)
    x = torch.randn(2, 7, dim, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 7, dim, dtype=dtype)
    expected = theirs(x)
    want = torch.autograd.grad(expected, (x, theirs.weight), grad)
    # autograd's gradient takes bf16 roundings lctrain's float32 backward does not
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 4e-2}
    for tile_rows in (3, 14):
        monkeypatch.setattr(norms, "NORM_TILE_ELEMENTS", tile_rows * dim)
        ours = norms.RMSNorm(dim, 1e-5, offset).to(dtype)
        ours.load_state_dict(theirs.state_dict())
        out = ours(x)
        assert torch.equal(out, expected)
        got = torch.autograd.grad(out, (x, ours.weight), grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **tol)
