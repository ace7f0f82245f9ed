"""Rank <-> coordinate math for every factorisation of 1..64 ranks, without processes."""

import itertools
import math

import numpy as np
import pytest

from lctrain.config import LctrainConfig
from lctrain.layout.topology import AXES, GROUPS, Topology


def factorisations(n: int, parts: int):
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorisations(n // d, parts - 1):
                yield (d, *rest)


def reference_groups(shape: tuple[int, ...], axes: tuple[str, ...]) -> list[list[int]]:
    """Independent reference: numpy's row-major rank array, group axes moved last."""
    mesh = np.arange(math.prod(shape)).reshape(shape)
    idx = [AXES.index(a) for a in axes]
    rest = [i for i in range(len(AXES)) if i not in idx]
    return mesh.transpose(rest + idx).reshape(-1, math.prod(shape[i] for i in idx)).tolist()


@pytest.mark.parametrize("worlds", [range(1, 33), pytest.param(range(33, 65),
                                                               marks=pytest.mark.slow)],
                         ids=["1-32", "33-64"])
def test_every_layout_of_1_to_64_ranks(worlds):
    checked = 0
    for world in worlds:
        for shape in factorisations(world, len(AXES)):
            topo = Topology(**dict(zip(AXES, shape)))
            assert topo.world_size == world
            expected = np.unravel_index(np.arange(world), shape)  # tp fastest
            for r in range(world):
                c = topo.coords(r)
                assert [c[a] for a in AXES] == [int(e[r]) for e in expected]
                assert topo.rank(**c) == r
            for name, (axes, _) in GROUPS.items():
                assert topo.groups(name) == reference_groups(shape, axes), (shape, name)
                assert topo.group_size(name) == math.prod(getattr(topo, a) for a in axes)
                if world <= 24:  # axis_rank is per rank: check it on the smaller worlds
                    for g in topo.groups(name):
                        assert [topo.axis_rank(r, name) for r in g] == list(range(len(g)))
            checked += 1
    assert checked > (1100 if worlds.start == 1 else 2500)


def test_tp_and_ulysses_are_innermost():
    topo = Topology(pp=2, dp=2, cp_ring=2, cp_ulysses=2, tp=2)
    assert topo.group_of(0, "tp") == [0, 1]
    assert topo.group_of(0, "cp_ulysses") == [0, 2]
    assert topo.group_of(0, "cp_ring") == [0, 4]
    assert topo.group_of(0, "cp") == [0, 2, 4, 6]
    assert topo.group_of(0, "dp") == [0, 8]
    assert topo.group_of(1, "dp_cp") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert topo.group_of(0, "pp") == [0, 16]
    # one node of 8 GPUs holds a whole tp x cp_ulysses x cp_ring block
    assert all(r // 8 == 0 for r in topo.group_of(0, "cp"))


def test_from_config_derives_dp_and_cp_split():
    cfg = LctrainConfig()
    cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.attention = 2, 8, "usp"
    cfg.parallel.ulysses_degree = 2
    topo = Topology.from_config(cfg, 64)
    assert (topo.pp, topo.dp, topo.cp_ring, topo.cp_ulysses, topo.tp) == (1, 4, 4, 2, 2)
    cfg.parallel.attention, cfg.parallel.ulysses_degree = "ulysses", 1
    assert Topology.from_config(cfg, 64).cp_ulysses == 8
    cfg.parallel.attention = "ring"
    assert Topology.from_config(cfg, 64).cp_ring == 8


def test_axis_rank_matches_coordinates():
    topo = Topology(dp=3, cp_ring=2, tp=2)
    for r in range(topo.world_size):
        c = topo.coords(r)
        assert topo.axis_rank(r, "dp") == c["dp"]
        assert topo.axis_rank(r, "dp_cp") == c["dp"] * 2 + c["cp_ring"]
    assert list(itertools.chain(*topo.groups("tp"))) == list(range(12))
