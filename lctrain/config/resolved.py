"""The resolved config as YAML (config.yaml, checkpoints) or plain data (W&B), secrets redacted.

Written with PyYAML alone (no OmegaConf), so that training needs no CLI stack.
"""

from __future__ import annotations

import dataclasses
import os
import re

import yaml

from lctrain.config.schema import LctrainConfig

_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with the value of every secret-looking environment variable (WANDB_API_KEY,
    HF_TOKEN, ...) replaced: a value interpolated into the config never reaches a file or log."""
    for name, value in os.environ.items():
        if _SECRET_NAME.search(name) and len(value) >= 8:
            text = text.replace(value, f"<{name} redacted>")
    return text


def _redacted(value: object) -> object:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {_redacted(k): _redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(v) for v in value]
    return value


def as_dict(cfg: LctrainConfig) -> dict:
    """The resolved config as plain data (W&B), secrets redacted."""
    return _redacted(dataclasses.asdict(cfg))  # type: ignore[return-value]


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, which quotes every string YAML 1.1 would read as another type, and
    also those OmegaConf's loader reads as floats (1e5, nan: it extends YAML 1.1's float rule)."""


def _represent_str(dumper: yaml.SafeDumper, text: str):
    try:
        float(text)
    except ValueError:
        return dumper.represent_str(text)
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="'")


_Dumper.add_representer(str, _represent_str)


def to_yaml(cfg: LctrainConfig) -> str:
    """The resolved config as YAML (config.yaml, checkpoints), secrets redacted: block style in
    field order, as `OmegaConf.to_yaml` writes it."""
    return yaml.dump(as_dict(cfg), Dumper=_Dumper, default_flow_style=False,
                     allow_unicode=True, sort_keys=False)
