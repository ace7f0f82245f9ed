"""What a Hugging Face config.json says about the model: lctrain's `model.*` values (the family
from model_type), and the architecture features lctrain cannot honour, for every registered
family (`lctrain.config.model_families`: what each family has decides what is refused).

Both layouts of the RoPE settings are read: the older top-level `rope_theta` + `rope_scaling`
(the released Llama 3.x, SmolLM2 checkpoints) and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import json
from pathlib import Path

from lctrain.config import ModelConfig, choices_of
from lctrain.config.model_families import MODEL_FAMILIES, model_family
from lctrain.config.model_parts import EXPERTS, LINEAR_ATTENTION, OUTPUT_GATE, QKV_BIAS, WINDOWS
from lctrain.config.schema import FULL, LINEAR, SLIDING

# config.json key -> ModelConfig field (plain copies)
_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
           "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
           "intermediate_size": "ffn_dim", "tie_word_embeddings": "tie_embeddings",
           "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_position_embeddings"}
# rope parameter -> ModelConfig field
_ROPE = {"rope_theta": "rope_theta", "rope_type": "rope_type", "factor": "rope_factor",
         "low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor",
         "original_max_position_embeddings": "rope_original_max_position",
         "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
         "truncate": "rope_truncate"}
LINEAR_FIELDS = {"linear_num_key_heads": "linear_key_heads",
           "linear_num_value_heads": "linear_value_heads",
           "linear_key_head_dim": "linear_key_dim", "linear_value_head_dim": "linear_value_dim",
           "linear_conv_kernel_dim": "linear_conv_kernel"}
"""config.json key -> ModelConfig field of a family with Gated DeltaNet layers."""
_TEXT_ONLY_ROPE = ("mrope_section", "mrope_interleaved")
"""Multimodal RoPE's sections (Qwen3.5): a text token has the same position on every section,
so on text they rotate as plain RoPE does."""
_ACTIVATIONS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}
"""`ModelFamily.mlp_activation` -> config.json's names for it."""
SHAPE_FIELDS = ("family", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "ffn_dim", "tie_embeddings", "n_experts", "expert_ffn_dim",
                "shared_expert_ffn_dim", "moe_layers",
                *LINEAR_FIELDS.values())
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


LANGUAGE_MODEL_PREFIX = "model.language_model."
"""Where a multimodal checkpoint (Qwen3.5's releases) keeps its language model's tensors,
instead of `model.`; its output layer stays `lm_head`."""


def language_model(hf: dict) -> tuple[dict, str | None]:
    """(the language model's config, a note) of config.json: itself (with a note where it has
    multi-token-prediction layers: Qwen3-Next's, left out), or for a multimodal checkpoint
    whose `text_config` is a registered family (Qwen3.5's releases, model_type qwen3_5 or
    qwen3_5_moe) that text config, with the top level's tie_word_embeddings where it has none,
    and a note that the vision tower and the multi-token-prediction layers are left out."""
    text = hf.get("text_config")
    if not isinstance(text, dict) or text.get("model_type") not in MODEL_FAMILIES:
        mtp = hf.get("mtp_num_hidden_layers") or hf.get("num_nextn_predict_layers") or 0
        return hf, (f"model.init_from: config.json has {mtp} multi-token-prediction layer(s) "
                    "(mtp.*); lctrain trains the language model without them: they are left "
                    "out of the model and of an export" if mtp else None)
    text = dict(text)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    mtp = text.get("mtp_num_hidden_layers") or 0
    note = (f"model.init_from: config.json is a {hf.get('model_type')} checkpoint with a vision "
            f"tower; lctrain trains its language model ({text['model_type']}: the "
            f"{LANGUAGE_MODEL_PREFIX}* tensors and lm_head), the vision tower"
            + (f" and the {mtp} multi-token-prediction layer(s) (mtp.*)" if mtp else "")
            + " are left out of the model and of an export")
    return text, note


def _rope(hf: dict) -> dict:
    """The RoPE settings of config.json as one dict (rope_type, rope_theta, factor, ...): the
    full layers' where each layer type has its own (Gemma 3)."""
    params = dict(hf.get("rope_parameters") or {})
    params = dict(params.get(FULL, params))
    scaling = hf.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    if "type" in params and "rope_type" not in params:  # transformers < 4.45 spelling
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def window(hf: dict) -> int | None:
    """The sliding attention window config.json turns on (None: none). Qwen2 and Qwen3 store a
    window even when use_sliding_window is false, and then attend over everything."""
    if hf.get("use_sliding_window") is False:
        return None
    return hf.get("sliding_window")


def _local_theta(hf: dict) -> float | None:
    """The sliding layers' RoPE base where it is their own (Gemma 3: rope_parameters'
    sliding_attention, or the older rope_local_base_freq)."""
    local = (hf.get("rope_parameters") or {}).get(SLIDING) or {}
    theta = local.get("rope_theta", hf.get("rope_local_base_freq"))
    return None if theta is None else float(theta)


def layer_types(hf: dict) -> list[str] | None:
    """Each layer's mixer (model.layer_types): config.json's layer_types, or from Gemma's
    sliding_window_pattern (every pattern-th layer full), Qwen's max_window_layers (layers
    from it on sliding) or Qwen3.5's full_attention_interval (every interval-th layer full, the
    others linear), as transformers derives them; None when every layer is the default
    (sliding with a window, else full)."""
    n, w = hf.get("num_hidden_layers", 0), window(hf)
    if hf.get("layer_types"):
        types = list(hf["layer_types"])
    elif _has_linear(hf):
        every = hf.get("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % every else FULL for i in range(n)]
    elif w is not None and "sliding_window_pattern" in hf:
        types = [SLIDING if (i + 1) % hf["sliding_window_pattern"] else FULL for i in range(n)]
    elif w is not None and "max_window_layers" in hf:
        types = [SLIDING if i >= hf["max_window_layers"] else FULL for i in range(n)]
    else:
        return None
    default = SLIDING if w is not None else FULL
    return None if all(t == default for t in types) else types


def _has_linear(hf: dict) -> bool:
    kind = hf.get("model_type")
    return kind in MODEL_FAMILIES and model_family(kind).has(LINEAR_ATTENTION)


def model_fields(hf: dict) -> dict:
    """lctrain's model.* values that config.json defines (fields it leaves out are absent)."""
    out = {ours: hf[key] for key, ours in _FIELDS.items() if key in hf}
    if hf.get("model_type") in MODEL_FAMILIES:
        out["family"] = hf["model_type"]
    if "num_key_value_heads" not in hf and "num_attention_heads" in hf:
        out["n_kv_heads"] = hf["num_attention_heads"]
    out.setdefault("tie_embeddings", False)  # the config classes' default
    heads, dim, head_dim = hf.get("num_attention_heads"), hf.get("hidden_size"), hf.get("head_dim")
    if heads and dim:  # a head dim of dim / n_heads is model.head_dim=null (derived)
        out["head_dim"] = None if head_dim is None or head_dim * heads == dim else head_dim
    out["sliding_window"] = window(hf)
    out["layer_types"] = layer_types(hf)
    out["rope_local_theta"] = _local_theta(hf)
    if hf.get("query_pre_attn_scalar") is not None:
        out["query_pre_attn_scalar"] = int(hf["query_pre_attn_scalar"])
    out.update(_experts(hf))
    if _has_linear(hf):
        out.update({ours: hf[key] for key, ours in LINEAR_FIELDS.items() if key in hf})
    rope = _rope(hf)
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if fraction is not None:
        out["rotary_fraction"] = float(fraction)
    out.update({ours: rope[key] for key, ours in _ROPE.items() if key in rope})
    for name in ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_beta_fast", "rope_beta_slow", "norm_eps"):
        if name in out:
            out[name] = float(out[name])
    return out


def _experts(hf: dict) -> dict:
    """The mixture-of-experts fields of a family with experts: their number (Qwen3-MoE's
    num_experts, Mixtral's num_local_experts), k, the experts' width (moe_intermediate_size, or
    Mixtral's intermediate_size), which layers have them (every decoder_sparse_step-th one not
    in mlp_only_layers, as transformers decides), the routing's renormalisation and the aux-loss
    weight (applied as transformers applies it with output_router_logits)."""
    kind = hf.get("model_type")
    if kind not in MODEL_FAMILIES or not model_family(kind).has(EXPERTS):
        return {}
    n = hf.get("num_experts", hf.get("num_local_experts", 0))
    out = {"n_experts": n, "experts_per_token": hf.get("num_experts_per_tok", 2),
           "expert_ffn_dim": hf.get("moe_intermediate_size"),
           "shared_expert_ffn_dim": hf.get("shared_expert_intermediate_size"),
           "norm_topk_prob": hf.get("norm_topk_prob", True),
           "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0))}
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    layers = [i for i in range(hf.get("num_hidden_layers", 0))
              if i not in dense and (i + 1) % step == 0]
    out["moe_layers"] = None if len(layers) == hf.get("num_hidden_layers", 0) else layers
    out.update({key: float(hf[key]) for key in ("swiglu_limit", "swiglu_alpha") if key in hf})
    return out


def unsupported(hf: dict, path: str) -> list[str]:
    """What config.json asks for that lctrain's model of its family does not compute, by name.
    (A sliding window shorter than the sequence is refused by validation, which knows
    train.seq_len.)"""
    problems = []
    where = f"model.init_from={path}: config.json"
    kind = hf.get("model_type")
    if kind not in MODEL_FAMILIES:
        problems.append(f"model.init_from={path} is model_type={kind!r}; lctrain loads the "
                        f"model types {', '.join(MODEL_FAMILIES)} (docs/extending.md: adding a "
                        "model family)")
        return problems
    family = model_family(kind)
    if hf.get("attention_bias") and not family.has(QKV_BIAS):
        problems.append(f"{where} sets attention_bias=true; lctrain's {kind} has no attention "
                        "biases (the qwen2 family has Q/K/V biases)")
    if family.has(OUTPUT_GATE) and hf.get("attn_output_gate") is False:
        problems.append(f"{where} sets attn_output_gate=false; lctrain's {kind} gates every "
                        "attention output")
    if hf.get("mlp_bias"):
        problems.append(f"{where} sets mlp_bias=true; lctrain's MLPs have no biases")
    act, names = (hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
                  _ACTIVATIONS[family.mlp_activation])
    if act not in names:
        problems.append(f"{where} sets the MLP activation {act!r}; lctrain's {kind} uses "
                        f"{family.mlp_activation} ({', '.join(names)})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            problems.append(f"{where} sets {key}={hf[key]}; lctrain computes no logit "
                            "soft-capping")
    if hf.get("use_bidirectional_attention"):
        problems.append(f"{where} sets use_bidirectional_attention=true; lctrain trains causal "
                        "language models")
    if window(hf) is not None and not family.has(WINDOWS):
        problems.append(f"{where} sets sliding_window={hf['sliding_window']}; lctrain's {kind} "
                        "attends over the whole causal context")
    computed = {FULL, SLIDING} | ({LINEAR} if family.has(LINEAR_ATTENTION) else set())
    other_types = set(hf.get("layer_types") or ()) - computed
    if other_types:
        problems.append(f"{where} has layer_types {sorted(other_types)}; lctrain's {kind} "
                        f"computes {', '.join(sorted(computed))} layers only")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        problems.append(f"{where} has quantization_config (quant_method {method}); lctrain "
                        "trains unquantized weights: start from a bf16/fp32 release or "
                        "dequantize the checkpoint first")
    if hf.get("router_jitter_noise"):
        problems.append(f"{where} sets router_jitter_noise={hf['router_jitter_noise']}; "
                        "lctrain's routers take no noise (set it to 0.0)")
    rope = _rope(hf)
    if rope["rope_type"] not in choices_of(ModelConfig, "rope_type"):
        problems.append(f"{where} uses rope_type={rope['rope_type']!r}; lctrain implements "
                        f"{', '.join(choices_of(ModelConfig, 'rope_type'))}")
    extra = set(rope) - set(_ROPE) - {"type", "partial_rotary_factor", *_TEXT_ONLY_ROPE}
    if extra:
        problems.append(f"{where} sets RoPE parameters lctrain does not implement: "
                        f"{', '.join(sorted(extra))}")
    return problems
