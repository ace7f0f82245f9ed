"""The context-parallel attention algorithms, as the config layer sees them: one registry entry
per algorithm holding its name (a value of `parallel.attention`), where it is derived, how it
splits the heads (its Ulysses degree) and which Ulysses degrees the layout search tries.

The code that runs an algorithm is registered under the same name in
`lctrain.attention.algorithms`, and what it sends, keeps and costs in time
(docs/parallelism.md §5-8, §11, §15-17) in `lctrain.planning.cp_costs`; docs/extending.md is
the checklist for adding one. This module imports nothing from lctrain but the registry: it
sits in the config layer, so that the schema reads its names (`one_of(registry=CP_ALGORITHMS)`)
and every layer above asks it instead of comparing names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lctrain.config.registry import Registry

HEADS_OVER = ("none", "cp", "ulysses_degree")
"""The values of `CPAlgorithm.heads_over`."""


def _degree_one(cp: int) -> tuple[int, ...]:
    return (1,)


@dataclass(frozen=True)
class CPAlgorithm:
    """Everything a layer asks about one context-parallel algorithm, but the code that runs it
    and its costs."""

    name: str
    doc: str
    """Where its formulas are derived (docs/parallelism.md §N)."""
    summary: str
    """One line for `lctrain keys` and the docs."""
    heads_over: str
    """Which ranks split the heads, i.e. its Ulysses degree: none (1) | cp (all of them) |
    ulysses_degree (parallel.ulysses_degree of them, a ring across the groups)."""
    searched_degrees: Callable[[int], tuple[int, ...]] = _degree_one
    """parallel.ulysses_degree values `plan.search` tries at `cp` ranks."""

    def __post_init__(self):
        assert self.heads_over in HEADS_OVER, (self.name, self.heads_over)

    def degree(self, cp: int, ulysses_degree: int) -> int:
        """Its Ulysses degree at `cp` ranks (`ulysses_degree`: parallel.ulysses_degree)."""
        if cp == 1:
            return 1
        return {"none": 1, "cp": cp, "ulysses_degree": ulysses_degree}[self.heads_over]

    @property
    def degree_key(self) -> str | None:
        """The key that sets its Ulysses degree (None: it splits no heads)."""
        return None if self.heads_over == "none" else f"parallel.{self.heads_over}"


CP_ALGORITHMS: Registry[CPAlgorithm] = Registry("context-parallel attention algorithm")
"""The registered algorithms; their names are the values `parallel.attention` takes."""


def algorithm_layouts(cp: int) -> list[tuple[str, int]]:
    """(algorithm, Ulysses degree) of every registered algorithm on `cp` ranks, at each
    parallel.ulysses_degree `plan.search` tries (USP: 2 on 4 ranks, 2 and 4 on 8, none on 2):
    the cases the tests and the GPU check run every algorithm at."""
    return [(a.name, a.degree(cp, setting)) for a in CP_ALGORITHMS.entries()
            for setting in a.searched_degrees(cp)]


def layout_overrides(name: str, cp: int, ulysses: int) -> dict:
    """The parallel.* values of algorithm `name` on `cp` ranks at Ulysses degree `ulysses`."""
    key = CP_ALGORITHMS[name].degree_key
    return {"cp": cp, "attention": name, **({key.split(".")[1]: ulysses}
                                            if key == "parallel.ulysses_degree" else {})}


def cp_algorithm(name: str) -> CPAlgorithm:
    return CP_ALGORITHMS[name]


def register(algorithm: CPAlgorithm) -> CPAlgorithm:
    return CP_ALGORITHMS.add(algorithm)


def usp_degrees(cp: int) -> tuple[int, ...]:
    """Ulysses degrees strictly between 1 and cp (1 is Ring, cp is Ulysses)."""
    return tuple(u for u in range(2, cp) if cp % u == 0)


register(CPAlgorithm(
    "ulysses", "docs/parallelism.md §5",
    "all-to-all of Q, K, V and the output: each rank attends the whole sequence for H/cp heads",
    heads_over="cp"))
register(CPAlgorithm(
    "ring", "docs/parallelism.md §6",
    "K/V blocks passed around the cp ranks, each step's attention merged by its lse",
    heads_over="none"))
register(CPAlgorithm(
    "usp", "docs/parallelism.md §7",
    "Ulysses over parallel.ulysses_degree ranks, a ring across those groups",
    heads_over="ulysses_degree", searched_degrees=usp_degrees))
register(CPAlgorithm(
    "allgather", "docs/parallelism.md §8",
    "K and V all-gathered before the attention, their gradients reduce-scattered after",
    heads_over="none"))
