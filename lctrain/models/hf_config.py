"""What a Hugging Face Llama config.json says about the model: lctrain's `model.*` values, and
the architecture features lctrain cannot honour.

Both layouts of the RoPE settings are read: the older top-level `rope_theta` + `rope_scaling`
(the released Llama 3.x, SmolLM2 checkpoints) and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import json
from pathlib import Path

from lctrain.config import ModelConfig, choices_of

# config.json key -> ModelConfig field (plain copies)
_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
           "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
           "intermediate_size": "ffn_dim", "tie_word_embeddings": "tie_embeddings",
           "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_position_embeddings"}
# rope parameter -> ModelConfig field
_ROPE = {"rope_theta": "rope_theta", "rope_type": "rope_type", "factor": "rope_factor",
         "low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor",
         "original_max_position_embeddings": "rope_original_max_position",
         "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow"}
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                "tie_embeddings")
"""Fields the weights fix: model.hf_overrides cannot change them."""


def read_hf_config(path: str | Path) -> dict:
    """config.json of a Hugging Face model directory (a ValueError says what is missing)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"model.init_from={path} has no config.json; point it at a Hugging Face "
                         "model directory (config.json + *.safetensors)")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from e


def _rope(hf: dict) -> dict:
    """The RoPE settings of config.json as one dict (rope_type, rope_theta, factor, ...)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    if "type" in params and "rope_type" not in params:  # transformers < 4.45 spelling
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def model_fields(hf: dict) -> dict:
    """lctrain's model.* values that config.json defines (fields it leaves out are absent)."""
    out = {ours: hf[key] for key, ours in _FIELDS.items() if key in hf}
    if "num_key_value_heads" not in hf and "num_attention_heads" in hf:
        out["n_kv_heads"] = hf["num_attention_heads"]
    out.setdefault("tie_embeddings", False)  # LlamaConfig's default
    rope = _rope(hf)
    out.update({ours: rope[key] for key, ours in _ROPE.items() if key in rope})
    for name in ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_beta_fast", "rope_beta_slow", "norm_eps"):
        if name in out:
            out[name] = float(out[name])
    return out


def unsupported(hf: dict, path: str) -> list[str]:
    """What config.json asks for that lctrain's Llama does not compute, by name."""
    problems = []
    where = f"model.init_from={path}: config.json"
    if hf.get("model_type") != "llama":
        problems.append(f"model.init_from={path} is model_type={hf.get('model_type')!r}; "
                        "lctrain loads Llama checkpoints (model_type llama) only")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{where} sets {key}=true; lctrain's Llama has no biases")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        problems.append(f"{where} sets hidden_act={hf['hidden_act']!r}; lctrain's SwiGLU uses "
                        "silu")
    if hf.get("sliding_window") is not None:
        problems.append(f"{where} sets sliding_window={hf['sliding_window']}; lctrain attends "
                        "over the whole causal context")
    rope = _rope(hf)
    if rope["rope_type"] not in choices_of(ModelConfig, "rope_type"):
        problems.append(f"{where} uses rope_type={rope['rope_type']!r}; lctrain implements "
                        f"{', '.join(choices_of(ModelConfig, 'rope_type'))}")
    extra = set(rope) - set(_ROPE) - {"type"}
    if extra:
        problems.append(f"{where} sets RoPE parameters lctrain does not implement: "
                        f"{', '.join(sorted(extra))}")
    heads, dim = hf.get("num_attention_heads"), hf.get("hidden_size")
    if heads and dim and hf.get("head_dim") not in (None, dim // heads):
        problems.append(f"{where} sets head_dim={hf['head_dim']}, not hidden_size / "
                        f"num_attention_heads = {dim // heads}; lctrain derives the head dim")
    return problems
