"""What a checkpoint directory holds and how it is read: the file names and the manifest check
(from lctrain.rundir.checkpoint_dirs; the layout is listed in lctrain.training.checkpoint's
docstring), a DCP metadata reader that runs no code, the per-rank RNG states, the tensors DCP
saves, and whole weights read by one process.

Pure file access with no collectives, so the checkpointer, `lctrain status`, tools/export_hf.py
and the fault benchmarks all verify and read checkpoints the same way.
"""

from __future__ import annotations

import io
import json
import pickle
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from lctrain import device
from lctrain.models.registry import new_model
from lctrain.rundir.files import write_synced


def write_json(path: Path, value: object) -> None:
    write_synced(path, json.dumps(value, indent=1, sort_keys=True).encode())


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: admit only the classes it is made of."""

    ALLOWED = {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
               ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
               ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is "
                                     "not part of a DCP checkpoint; refusing to load it")


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata load can run no code."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def rng_state() -> dict:
    """This rank's Python, NumPy and torch RNG states as JSON-able values."""
    py = random.getstate()
    out = {"python": [py[0], list(py[1]), py[2]], "numpy": None,
           "torch": torch.get_rng_state().tolist()}
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    cuda = device.rng_state()
    if cuda is not None:
        out["cuda"] = cuda
    return out


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state:
        device.set_rng_state(state["cuda"])


def tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """({"model": ..., "optim": ...} tensors for DCP, the optimizer's full state dict)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd["state"]}, optim_sd


def full_weights(path: Path, cfg) -> dict[str, torch.Tensor]:
    """The whole weights of a DCP checkpoint (any layout), read by this process alone."""
    model = new_model(cfg.model)  # unsharded, on the CPU: DCP reshards any layout into it
    weights = {"model": get_model_state_dict(model)}
    dcp.load(weights, storage_reader=SafeReader(path), no_dist=True)
    return weights["model"]
