"""The model config of a run that starts from a Hugging Face checkpoint: its config.json
decides every model.* field it defines, and each field's origin is recorded.

A value from a recipe or a model preset yields to config.json (the change is reported). A
value typed on the command line that contradicts config.json is an error naming both, unless
the field is listed in model.hf_overrides, which keeps this config's value on purpose (context
extension: rope_theta, rope scaling). Floats are compared as float32 values (`same_value`),
the precision many checkpoints store them in. Shape fields cannot be overridden. What lctrain cannot
compute (biases, other activations, sliding windows, other RoPE types) is refused by name.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

from lctrain.config import ConfigError, ModelConfig
from lctrain.config.compose import Composed
from lctrain.config.validation import init_from_problems
from lctrain.models.hf_config import (
    SHAPE_FIELDS,
    language_model,
    model_fields,
    read_hf_config,
    unsupported,
)

FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def same_value(ours: object, theirs: object) -> bool:
    """Whether a model field's value equals config.json's: a float as a float32 value, since
    many config.json files were written from float32 (rms_norm_eps stored as
    9.999999747378752e-06 is model.norm_eps=1e-5); booleans only to booleans; integers and
    anything else exactly."""
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return type(ours) is type(theirs) and ours == theirs
    if isinstance(ours, float) or isinstance(theirs, float):
        return isinstance(ours, int | float) and isinstance(theirs, int | float) and \
            _float32(ours) == _float32(theirs)
    return ours == theirs


def typed_keys(overrides: list[str], section: str) -> set[str]:
    """Fields of `section` set on the command line (`section.key=...`, also with + or ++)."""
    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith(section + "."):
            keys.add(key[len(section) + 1:])
    return keys


def _origins(model: ModelConfig, typed: set[str]) -> dict[str, str]:
    default = ModelConfig()
    return {name: "command line" if name in typed else
            "default" if getattr(model, name) == getattr(default, name) else "recipe or preset"
            for name in FIELDS}


def _override_problems(model: ModelConfig) -> list[str]:
    bad = [n for n in model.hf_overrides if n not in FIELDS or n in SHAPE_FIELDS
           or n in ("init_from", "hf_overrides")]
    if not bad:
        return []
    allowed = [n for n in FIELDS if n not in SHAPE_FIELDS and n not in ("init_from",
                                                                       "hf_overrides")]
    return [f"model.hf_overrides lists {', '.join(bad)}; only these fields can replace "
            f"config.json's values: {', '.join(allowed)} (the weights fix the shape)"]


def resolve_model(composed: Composed) -> Composed:
    """`composed` with the model fields of model.init_from's config.json and their origins."""
    cfg, typed = composed.cfg, typed_keys(composed.overrides, "model")
    model = cfg.model
    origins = _origins(model, typed)
    if model.init_from is None:
        if model.hf_overrides:
            raise ConfigError(["model.hf_overrides is set but model.init_from is not; it names "
                               "the config.json values to replace, so set model.init_from=DIR "
                               "or model.hf_overrides=[]"])
        return dataclasses.replace(composed, origins=origins)
    missing = init_from_problems(model)
    if missing:  # the first and only problem: every other model check would judge defaults
        raise ConfigError(missing)
    try:
        hf, wrapped = language_model(read_hf_config(model.init_from))
    except ValueError as e:
        raise ConfigError([str(e)]) from e
    problems = unsupported(hf, model.init_from) + _override_problems(model)
    changes, notes = {}, [wrapped] if wrapped else []
    for name, theirs in model_fields(hf).items():
        ours = getattr(model, name)
        if name in model.hf_overrides:
            origins[name] = "hf_overrides"
            if not same_value(ours, theirs):
                notes.append(f"model.{name}={ours!r} replaces config.json's {theirs!r} "
                             "(model.hf_overrides)")
        elif name in typed and not same_value(ours, theirs):
            problems.append(f"model.{name}={ours!r} on the command line contradicts "
                            f"{Path(model.init_from) / 'config.json'}, which has {theirs!r}; "
                            f"drop the override, or list it in model.hf_overrides=[{name}] to "
                            "change the model on purpose")
        else:
            if not same_value(ours, theirs):
                notes.append(f"model.{name}: {ours!r} ({origins[name]}) -> {theirs!r} "
                             "(config.json)")
                changes[name] = theirs
            origins[name] = "config.json"
    if problems:
        raise ConfigError(problems)
    if "name" not in typed:
        changes["name"] = Path(model.init_from).resolve().name
        origins["name"] = "model.init_from"
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(model, **changes))
    if cfg.data.tokenizer is None and (Path(model.init_from) / "tokenizer.json").is_file():
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                                tokenizer=model.init_from))
        notes.append(f"data.tokenizer: the tokenizer of model.init_from={model.init_from}")
    return dataclasses.replace(composed, cfg=cfg, origins=origins, notes=notes)
