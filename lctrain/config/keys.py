"""Every configuration key with its type, default, allowed values and meaning, read straight from
the schema (`lctrain keys`): the meaning is the docstring under each field, found by parsing the
modules that define the sections (lctrain/config/schema.py, schema_launch.py, schema_data.py),
so the listing never drifts from them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass

from lctrain.config.schema import LctrainConfig


@dataclass(frozen=True)
class Key:
    name: str
    """section.field"""
    type: str
    default: object
    allowed: str
    """the choices, or the lower bound, from the field's metadata ("" when free)"""
    doc: str
    registered: tuple[tuple[str, str], ...] = ()
    """For a field backed by a registry: each entry's name and summary, in registration order."""


def _field_docs() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the docstring literal that follows the field, in every module
    that defines a section."""
    root = LctrainConfig()
    modules = {inspect.getmodule(type(getattr(root, f.name)))
               for f in dataclasses.fields(LctrainConfig)}
    docs = {}
    for node in (n for m in modules for n in ast.parse(inspect.getsource(m)).body):
        if not isinstance(node, ast.ClassDef):
            continue
        for field, after in zip(node.body, node.body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[(node.name, field.target.id)] = " ".join(after.value.value.split())
    return docs


def sections() -> list[str]:
    return [f.name for f in dataclasses.fields(LctrainConfig)]


def keys(section: str | None = None) -> list[Key]:
    """The keys of one section (all sections when None), in schema order."""
    docs, root, out = _field_docs(), LctrainConfig(), []
    for top in dataclasses.fields(LctrainConfig):
        if section is not None and top.name != section:
            continue
        node = getattr(root, top.name)
        for f in dataclasses.fields(node):
            meta = f.metadata
            allowed = (" | ".join(map(str, meta["choices"])) if "choices" in meta
                       else f">= {meta['min']}" if meta.get("min") is not None else "")
            registry = getattr(meta.get("choices"), "registry", None)
            registered = () if registry is None else tuple(
                (name, registry[name].summary) for name in registry)
            out.append(Key(f"{top.name}.{f.name}", str(f.type), getattr(node, f.name), allowed,
                           docs.get((type(node).__name__, f.name), ""), registered))
    return out
