"""Hugging Face interop for every registered family: config and name mapping (weights are
identical), checking an HF directory against the model config, loading it into any layout (each
rank reads only its slices), and exporting one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lctrain.config import ModelConfig
from lctrain.config.model_families import MODEL_FAMILIES, model_family
from lctrain.models.hf_config import LANGUAGE_MODEL_PREFIX, LINEAR_FIELDS, language_model
from lctrain.models.hf_params import rope_parameters
from lctrain.models.init import local_slices
from lctrain.models.registry import family_code

# lctrain module path inside a block -> HF module path (Llama's; a family adds its own)
_LAYER_MAP = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def _layer_map(family: str) -> dict[str, str]:
    """Llama's block names with the family's own added or renamed (Gemma 3's ffn_norm is its
    pre_feedforward_layernorm)."""
    return {**_LAYER_MAP, **family_code(family).hf_names}


def to_hf_name(name: str, family: str) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m:
        return f"model.layers.{m.group(1)}.{_layer_map(family)[m.group(2)]}.{m.group(3)}"
    return f"{_TOP_MAP[name.removesuffix('.weight')]}.weight"


def hf_names(name: str, family: str, n_experts: int) -> list[str]:
    """The Hugging Face tensors of lctrain parameter `name`: its one tensor, or for a stacked
    expert matrix stored one tensor per expert (`FamilyCode.hf_params` with "{e}") one per
    expert, in expert order."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    named = family_code(family).hf_params
    if m and m.group(2) in named:
        template = f"model.layers.{m.group(1)}.{named[m.group(2)]}"
        return ([template.format(e=e) for e in range(n_experts)] if "{e}" in template
                else [template])
    return [to_hf_name(name, family)]


def hf_rows(name: str, cfg: ModelConfig) -> Tensor | None:
    """Where the rows of lctrain parameter `name` are in its Hugging Face tensor (row i at
    index[i], `FamilyCode.hf_rows`), or None where the orders are the same."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    rows = family_code(cfg.family).hf_rows
    return rows[m.group(2)](cfg) if m and m.group(2) in rows else None


def to_hf_order(name: str, full: Tensor, cfg: ModelConfig) -> Tensor:
    """lctrain's whole tensor `name` with its rows in Hugging Face's order."""
    rows = hf_rows(name, cfg)
    if rows is None:
        return full
    out = torch.empty_like(full)
    out[rows.to(full.device)] = full
    return out


def to_hf_state_dict(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """lctrain's state dict in Hugging Face names and row orders (one tensor each: a family
    whose checkpoints split experts apart is not mapped here, see `hf_names`)."""
    out = {hf_names(k, cfg.family, 1)[0]: to_hf_order(k, v, cfg) for k, v in state.items()}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def from_hf_state_dict(hf_state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The inverse of `to_hf_state_dict`."""
    family, tie_embeddings = cfg.family, cfg.tie_embeddings
    inverse, ours_of = {}, {h: ours for ours, h in _layer_map(family).items()}
    params_of = {h: ours for ours, h in family_code(family).hf_params.items() if "{e}" not in h}
    for k, v in hf_state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", k)
        named = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", k)
        if named and named.group(2) in params_of:
            inverse[f"layers.{named.group(1)}.{params_of[named.group(2)]}"] = v
        elif m:
            inverse[f"layers.{m.group(1)}.{ours_of[m.group(2)]}.{m.group(3)}"] = v
        else:
            inverse[{h: o for o, h in _TOP_MAP.items()}[k.removesuffix(".weight")] + ".weight"] = v
    if tie_embeddings:
        inverse["output.weight"] = inverse["tok_embeddings.weight"]
    for name, tensor in inverse.items():
        rows = hf_rows(name, cfg)
        if rows is not None:
            inverse[name] = tensor[rows.to(tensor.device)]
    return inverse


def hf_config(cfg: ModelConfig):
    """A transformers config of the family's class (LlamaConfig, Qwen2Config, ...) with the
    same architecture as `cfg`."""
    import transformers  # lazy: transformers takes seconds to import

    config_class = getattr(transformers, model_family(cfg.family).hf_config_class)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.d_head, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu")
    return config_class(**{**common, **family_code(cfg).hf_config(cfg)})


# HF config key -> ModelConfig field, for the shape check of model.init_from (and model_type
# -> family; head_dim, where config.json sets it, -> the head dim, set or derived)
_HF_SHAPE = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
             "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
             "intermediate_size": "ffn_dim", "tie_word_embeddings": "tie_embeddings",
             "head_dim": "head_dim", "num_experts": "n_experts", "num_local_experts": "n_experts",
             "shared_expert_intermediate_size": "shared_expert_ffn_dim",
             **LINEAR_FIELDS}


def check_hf_dir(path: str, cfg: ModelConfig) -> list[str]:
    """Problems with loading the HF directory `path` into a model of shape `cfg` (empty = ok)."""
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        return [f"model.init_from={path} has no config.json; point it at a Hugging Face model "
                "directory (config.json + *.safetensors)"]
    if not list(root.glob("*.safetensors")):
        return [f"model.init_from={path} has no *.safetensors file (pickled .bin weights are "
                "never loaded); convert them with transformers' save_pretrained"]
    hf = language_model(json.loads(config_file.read_text()))[0]
    if hf.get("model_type") not in MODEL_FAMILIES:
        return [f"model.init_from={path} is model_type={hf.get('model_type')!r}; lctrain loads "
                f"the model types {', '.join(MODEL_FAMILIES)}"]
    hf.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    hf.setdefault("tie_word_embeddings", False)
    if hf.get("head_dim") is None:  # derived from hidden_size, which is compared already
        hf.pop("head_dim", None)
    ours = {key: getattr(cfg, name) for key, name in _HF_SHAPE.items()}
    ours.update(model_type=cfg.family, head_dim=cfg.d_head)
    fields = {**_HF_SHAPE, "model_type": "family"}
    return [f"model.init_from: {key}={hf[key]} in {config_file} but model.{fields[key]}="
            f"{ours[key]}; set model.{fields[key]}={hf[key]}"
            for key in ours if key in hf and hf[key] != ours[key]]


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str) -> None:
    """Copy an HF directory's weights into `model` (plain or TP-sharded DTensors, before
    FSDP). Each rank reads only the slices it holds, straight from the safetensors files."""
    where = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            where.update({k: (file, k) for k in f.keys()})  # noqa: SIM118 (no __iter__)
    # a multimodal checkpoint keeps its language model's tensors under model.language_model.
    where.update({"model." + k.removeprefix(LANGUAGE_MODEL_PREFIX): at
                  for k, at in list(where.items()) if k.startswith(LANGUAGE_MODEL_PREFIX)})
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:  # tied output layer: loaded through the embedding
            continue
        seen.add(id(param))
        # a tied output layer without its embedding (a pipeline's last stage) reads the embedding
        tied_copy = name == "output.weight" and model.cfg.tie_embeddings
        names = hf_names("tok_embeddings.weight" if tied_copy else name, model.cfg.family,
                         model.cfg.n_experts)
        index = local_slices(param)
        fused = _fused_source(name, model.cfg.family) if names[0] not in where else None
        rows = hf_rows(name, model.cfg)
        if rows is not None:  # rows in another order: the whole tensor read, this rank's taken
            whole = _read_slice(path, where, names[0], name, param.shape,
                                tuple(slice(None) for _ in param.shape))
            local = whole[rows[index[0]]][(slice(None), *index[1:])]
        elif fused is not None:  # all experts in one tensor: this matrix's part of it
            stored, part, parts = fused
            width = param.shape[1]
            rows = range(width)[index[1]]
            index = (index[0], slice(rows.start + part * width, rows.stop + part * width),
                     *index[2:])
            local = _read_slice(path, where, stored, name,
                                (param.shape[0], parts * width, *param.shape[2:]), index)
        elif len(names) == 1:
            local = _read_slice(path, where, names[0], name, param.shape, index)
        else:  # one tensor per expert: this rank's experts, stacked
            local = torch.stack([_read_slice(path, where, names[e], name, param.shape[1:],
                                             index[1:])
                                 for e in range(*index[0].indices(param.shape[0])[:2])])
        target = param.to_local() if hasattr(param, "to_local") else param
        target.copy_(local.to(target.dtype))


def _fused_source(name: str, family: str) -> tuple[str, int, int] | None:
    """(the Hugging Face tensor holding every expert's matrix, which part, of how many) of a
    stacked expert parameter whose family's checkpoints may fuse them (`FamilyCode.hf_fused`);
    None for any other parameter."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    fused = family_code(family).hf_fused
    if not m or m.group(2) not in fused:
        return None
    stored, part, parts = fused[m.group(2)]
    return f"model.layers.{m.group(1)}.{stored}", part, parts


def _read_slice(path: str, where: dict[str, tuple[Path, str]], hf_name: str, name: str,
                shape, index: tuple) -> Tensor:
    """`index` of tensor `hf_name` of the HF directory `path` (the file and the name it is
    stored under, by tensor: `where`), checked to have `shape` (lctrain's `name`)."""
    if hf_name not in where:
        raise ValueError(f"{path} has no tensor {hf_name} (for {name}); is it a checkpoint "
                         "of this family and shape?")
    file, stored = where[hf_name]
    with safe_open(str(file), framework="pt") as f:
        piece = f.get_slice(stored)
        if tuple(piece.get_shape()) != tuple(shape):
            raise ValueError(f"{hf_name} in {path} has shape {piece.get_shape()}, the model "
                             f"expects {tuple(shape)}")
        return piece[index]


SHARD_BYTES = 2 * 2**30
"""Largest safetensors file export_hf writes before it starts the next one."""


def full_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, whole tensor) of each parameter of `model`, a DTensor gathered when its turn comes
    (collective over its mesh: iterate on every rank); a tied weight is listed once."""
    for name, param in model.named_parameters():
        yield name, param.full_tensor() if isinstance(param, DTensor) else param


@torch.no_grad()
def export_hf(parameters: Iterable[tuple[str, Tensor | None]], cfg: ModelConfig, out_dir: str,
              rank: int, shard_bytes: int = SHARD_BYTES) -> None:
    """Write a model as an HF directory of its family (config.json + safetensors, sharded with
    an index beyond `shard_bytes`) that `transformers.AutoModelForCausalLM.from_pretrained`
    loads.

    `parameters`: (lctrain name, whole tensor) pairs, produced one at a time (`full_parameters`,
    or a pipeline's, which brings every stage's to rank 0); only rank 0's tensors are used. Call
    on every rank. Rank 0 writes a file whenever it holds `shard_bytes`, and the other ranks
    drop each tensor at once, so no rank ever holds the whole model."""
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    files: list[dict[str, Tensor]] = []
    current: dict[str, Tensor] = {}
    size = 0
    for name, full in parameters:
        if rank != 0:
            continue
        names = hf_names(name, cfg.family, cfg.n_experts)
        full = to_hf_order(name, full, cfg)
        pieces = full.unbind(0) if len(names) > 1 else (full,)  # one tensor per expert
        for hf_name, piece in zip(names, pieces):
            current[hf_name] = piece.detach().float().cpu().contiguous()
            size += current[hf_name].nbytes
        if size >= shard_bytes:
            files.append(_write_shard(out, len(files), current))
            current, size = {}, 0
    if rank != 0:
        return
    if current or not files:
        files.append(_write_shard(out, len(files), current))
    _name_shards(out, files)
    hf_config(cfg).save_pretrained(str(out))


def _write_shard(out: Path, index: int, tensors: dict[str, Tensor]) -> dict:
    path = out / f".shard-{index:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return {"path": path, "names": list(tensors), "bytes": sum(t.nbytes for t in tensors.values())}


def _name_shards(out: Path, files: list[dict]) -> None:
    """Rename the shards as transformers expects: one model.safetensors, or numbered files with
    model.safetensors.index.json."""
    if len(files) == 1:
        files[0]["path"].rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, f in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        f["path"].rename(out / name)
        weight_map.update({n: name for n in f["names"]})
    index = {"metadata": {"total_size": sum(f["bytes"] for f in files)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
