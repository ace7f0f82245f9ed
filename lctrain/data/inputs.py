"""What `lctrain preprocess` reads: data.path (a file, a folder, a glob, or a hub dataset name)
resolved into `Input`s, in reading order (`resolve_inputs`). A `save_to_disk` folder is one
input, an `lctrain preprocess` output is never one, and a name that is neither a local path nor
a file we read is a hub dataset (refused while the hub is offline). lctrain.data.ingest streams
the rows of these inputs.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lctrain.config import DataConfig

SUFFIX_FORMATS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json": "json", ".json.gz": "json",
                  ".txt": "text", ".txt.gz": "text", ".md": "text", ".parquet": "parquet",
                  ".arrow": "arrow"}
EXPECTED = (f"files ending in {', '.join(SUFFIX_FORMATS)}, or a folder written by "
            "datasets' save_to_disk")


@dataclass(frozen=True)
class Input:
    kind: str
    """jsonl | json | text | parquet | arrow | disk (a save_to_disk folder) | hub."""
    path: str
    """File or folder path, or the hub dataset name."""


def hub_offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def looks_like_hub(spec: str) -> bool:
    """`name` or `owner/name`, and no file suffix we would read."""
    return (re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec) is not None and not spec.startswith(".")
            and _suffix_format(spec) is None)


def _suffix_format(name: str) -> str | None:
    name = name.lower()
    return next((fmt for suffix, fmt in SUFFIX_FORMATS.items() if name.endswith(suffix)), None)


def _is_saved_dataset(folder: Path) -> bool:
    return ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()) or (
        folder / "dataset_dict.json").is_file()


def _is_token_dataset(folder: Path) -> bool:
    """An `lctrain preprocess` output: never corpus input."""
    return (folder / "meta.json").is_file() and (folder / "docs-00000.npy").is_file()


def _saved_root(path: Path) -> Path | None:
    """The save_to_disk folder that is `path` or holds it directly."""
    return next((d for d in (path, path.parent) if d.is_dir() and _is_saved_dataset(d)), None)


def _file_input(path: Path, forced: str) -> Input | None:
    """The input a file is read as (None: not a file we read)."""
    kind = forced if forced not in ("auto", "hub") else _suffix_format(path.name)
    return None if kind is None else Input(kind, str(path))


def _from_glob(pattern: str, forced: str) -> list[Input]:
    """Files matched by a glob ('**' recursive), sorted by path; a save_to_disk folder is one
    input, and an `lctrain preprocess` output is none."""
    found: dict[str, Input] = {}
    for match in glob.glob(os.path.expanduser(pattern), recursive=True):
        path = Path(match)
        root = _saved_root(path) if forced in ("auto", "arrow") else None
        if root is not None:  # its folders and .arrow files stand for it, its .json files not
            if path.is_dir() or path.suffix == ".arrow":
                found[str(root)] = Input("disk", str(root))
        elif path.is_file() and not _is_token_dataset(path.parent) and (
                i := _file_input(path, forced)) is not None:
            found[i.path] = i
    saved = [Path(i.path) for i in found.values() if i.kind == "disk"]
    return sorted((i for i in found.values()  # a DatasetDict's splits go with it
                   if not any(s in Path(i.path).parents for s in saved)), key=lambda i: i.path)


def resolve_inputs(data: DataConfig) -> list[Input]:
    """The inputs data.path names, in reading order; ValueError if it names nothing readable."""
    spec, forced = data.path, data.format
    if forced == "hub":
        return [_hub_input(spec)]
    path = Path(spec).expanduser()
    if path.is_dir() and _is_token_dataset(path):
        raise ValueError(f"data.path={spec!r} is already a preprocessed token dataset; train on it "
                         f"with data.source=tokens data.path={spec}")
    if path.is_dir():  # hidden names are skipped, as by any glob
        inputs = _from_glob(os.path.join(glob.escape(str(path)), "**"), forced)
    elif path.is_file():
        inputs = [i] if (i := _file_input(path, forced)) else []
    elif glob.has_magic(spec):
        inputs = _from_glob(spec, forced)
    elif forced == "auto" and looks_like_hub(spec):
        return [_hub_input(spec)]
    else:
        raise ValueError(f"data.path={spec!r} does not exist; give a file, a folder, a glob such "
                         "as 'corpus/*.jsonl' or a hub dataset name")
    if not inputs:
        raise ValueError(f"data.path={spec!r} has nothing to read; expected {EXPECTED} (or set "
                         "data.format to read other files as jsonl, json or text)")
    return inputs


def _hub_input(spec: str) -> Input:
    if hub_offline():
        raise ValueError(f"data.path={spec!r} does not exist locally and the Hugging Face hub is "
                         "offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); point data.path at a "
                         "local file, folder or glob, or go online to read the hub dataset")
    return Input("hub", spec)
