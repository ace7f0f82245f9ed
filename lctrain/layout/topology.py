"""Rank <-> coordinate math for the (pp, dp, cp_ring, cp_ulysses, tp) layout, and its named groups.

Axes are ordered outermost to innermost; tp and then cp_ulysses vary fastest, so the
bandwidth-hungry groups (TP/SP collectives, Ulysses all-to-all) land on neighbouring ranks,
i.e. inside a node (docs/parallelism.md §1). The math is pure, needs no process, and is tested
for every factorisation of 1..64 ranks; `lctrain.parallel.runtime` builds the meshes from it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cache, cached_property

from lctrain.config import LctrainConfig, derive

AXES = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")

# Named groups: the mesh axes they span and the traffic they carry.
GROUPS: dict[str, tuple[tuple[str, ...], str]] = {
    "tp": (("tp",), "TP/SP: activation all-gather and reduce-scatter along the sequence"),
    "cp_ulysses": (("cp_ulysses",), "Ulysses all-to-all of Q, K, V and the attention output"),
    "cp_ring": (("cp_ring",), "Ring P2P of K/V blocks (forward) and dK/dV (backward)"),
    "cp": (("cp_ring", "cp_ulysses"), "all-gather KV attention; context-parallel data split"),
    "dp": (("dp",), "data parallel: distinct sequences"),
    "dp_cp": (("dp", "cp_ring", "cp_ulysses"),
              "gradient reduction and loss token count (weights replicated over dp x cp)"),
    "pp": (("pp",), "pipeline P2P of activations and their gradients"),
}


@dataclass(frozen=True)
class Topology:
    """Sizes of each axis; immutable. `Topology.from_config(cfg, world_size)` after validation."""

    pp: int = 1
    dp: int = 1
    cp_ring: int = 1
    cp_ulysses: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            assert getattr(self, axis) >= 1, f"{axis}={getattr(self, axis)} must be >= 1"

    @classmethod
    def from_config(cls, cfg: LctrainConfig, world_size: int) -> Topology:
        d = derive(cfg, world_size)
        return cls(pp=cfg.parallel.pp, dp=d.dp, cp_ring=d.cp_ring, cp_ulysses=d.cp_ulysses,
                   tp=cfg.parallel.tp)

    @cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    @cached_property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def cp(self) -> int:
        return self.cp_ring * self.cp_ulysses

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of `rank` on every axis (row-major over AXES, tp fastest)."""
        assert 0 <= rank < self.world_size, f"rank {rank} outside world {self.world_size}"
        out = [0] * len(AXES)
        for i in range(len(AXES) - 1, -1, -1):
            rank, out[i] = divmod(rank, self.shape[i])
        return dict(zip(AXES, out))

    def rank(self, **coords: int) -> int:
        """Inverse of `coords`; missing axes count as 0."""
        r = 0
        for axis, size in zip(AXES, self.shape):
            c = coords.get(axis, 0)
            assert 0 <= c < size, f"{axis}={c} outside [0, {size})"
            r = r * size + c
        return r

    def axis_rank(self, rank: int, group: str) -> int:
        """Rank of `rank` inside the named group (row-major over the group's axes)."""
        c = self.coords(rank)
        r = 0
        for axis in GROUPS[group][0]:
            r = r * getattr(self, axis) + c[axis]
        return r

    def group_size(self, group: str) -> int:
        n = 1
        for axis in GROUPS[group][0]:
            n *= getattr(self, axis)
        return n

    @cached_property
    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each axis (row-major, tp stride 1)."""
        out, stride = {}, 1
        for axis, size in zip(reversed(AXES), reversed(self.shape)):
            out[axis] = stride
            stride *= size
        return out

    @cache  # noqa: B019 (instances are immutable and few)
    def groups(self, group: str) -> list[list[int]]:
        """Every instance of the named group, each as its ranks ordered by `axis_rank`."""
        axes = GROUPS[group][0]
        fixed = [a for a in AXES if a not in axes]

        def offsets(names):
            return [sum(c * self.strides[a] for a, c in zip(names, vals))
                    for vals in itertools.product(*(range(getattr(self, a)) for a in names))]

        members = offsets(axes)
        return [[base + m for m in members] for base in offsets(fixed)]

    def group_of(self, rank: int, group: str) -> list[int]:
        """The ranks of the named group that contains `rank`."""
        for members in self.groups(group):
            if rank in members:
                return members
        raise AssertionError("unreachable: every rank is in one group of each kind")
