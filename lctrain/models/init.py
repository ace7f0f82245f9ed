"""Initial weights that do not depend on the layout, drawn where they live.

Every parameter is initialised from its own random streams, one per block of ROWS rows, seeded
by (train.seed, parameter name, block). A rank that holds a shard of a parameter (TP, FSDP, or
both) draws only the row blocks its shard touches, one block at a time, and copies its slice:
the same seed gives the same global weights at any tp / cp / pp / dp, and no rank ever holds more
than its shard plus one block. A module says how its parameters start (`init_rules`): a normal
with a given std, ones (None) or zeros (`ZEROS`).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

ROWS = 1024
"""Rows per random stream: the most one rank draws at a time is ROWS x (other dims)."""
ZEROS = 0.0
"""The init rule of a parameter that starts at zero (a bias): a normal of std 0, not drawn."""


def local_slices(param: Tensor) -> tuple[slice, ...]:
    """Index of this rank's shard in the global tensor (all of it for a plain tensor)."""
    if not isinstance(param, DTensor):
        return tuple(slice(None) for _ in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _generator(seed: int, name: str, block: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


@torch.no_grad()
def fill_normal(param: Tensor, std: float, seed: int, name: str) -> None:
    """param's local part <- its slice of the global normal(0, std) tensor of (seed, name)."""
    target = param.to_local() if isinstance(param, DTensor) else param
    index = local_slices(param)
    rows = index[0].indices(param.shape[0])[:2] if param.ndim else (0, 1)
    rest = index[1:]
    for block in range(rows[0] // ROWS, -(-rows[1] // ROWS)):
        lo, hi = block * ROWS, min((block + 1) * ROWS, param.shape[0])
        values = torch.randn((hi - lo, *param.shape[1:]), generator=_generator(seed, name, block))
        a, b = max(lo, rows[0]), min(hi, rows[1])
        piece = values[(slice(a - lo, b - lo), *rest)] * std
        target[a - rows[0]:b - rows[0]].copy_(piece.to(target.dtype))


def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise every parameter of `model` (plain, TP- or FSDP-sharded) by its module's
    `init_rules()`: {relative name: std for a normal, None for ones, ZEROS for zeros}."""
    done: set[int] = set()
    for prefix, module in model.named_modules():
        rules = getattr(module, "init_rules", None)
        for rel, std in (rules() if rules else {}).items():
            name = f"{prefix}.{rel}" if prefix else rel
            param = module.get_parameter(rel)
            if id(param) in done:  # a tied weight: initialised through its first owner
                continue
            done.add(id(param))
            if std is None or std == ZEROS:
                with torch.no_grad():
                    local = param.to_local() if isinstance(param, DTensor) else param
                    local.fill_(1.0 if std is None else 0.0)
            else:
                fill_normal(param, std, seed, name)
