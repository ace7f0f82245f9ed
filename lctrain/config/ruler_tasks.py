"""The RULER-style tasks as every layer but their generator sees them (eval.tasks: the suite
`ruler` or single tasks by name): each task's facts, which `lctrain.data.ruler` builds
examples from and validation checks. In the config layer, so that the schema reads the names.
"""

from __future__ import annotations

from dataclasses import dataclass

RULER_SUITE = "ruler"
"""eval.tasks' name for every task of `RULER_TASKS`, in order."""


@dataclass(frozen=True)
class RulerTask:
    name: str
    kind: str
    """niah | vt | cwe | fwe."""
    haystack: str = "noise"
    """noise | text | needles: what fills the context around the task's statements."""
    keys: int = 1
    """Needles with distinct keys (niah; the asked ones among them), or chains (vt: one asked,
    the others distractors)."""
    values: int = 1
    """Values of each asked key (niah)."""
    queries: int = 1
    """Keys asked (niah)."""
    value_kind: str = "number"
    """number (7 digits) | uuid."""
    key_kind: str = "word"
    """word | uuid."""
    hops: int = 4
    """Assignments after the first in each chain (vt)."""
    top: int = 10
    """Words expected (cwe: the common ones; fwe: the most frequent)."""


RULER_TASKS = {t.name: t for t in (
    RulerTask("niah_single_1", "niah"),
    RulerTask("niah_single_2", "niah", haystack="text"),
    RulerTask("niah_single_3", "niah", haystack="text", value_kind="uuid"),
    RulerTask("niah_multikey_1", "niah", haystack="text", keys=4),
    RulerTask("niah_multikey_2", "niah", haystack="needles"),
    RulerTask("niah_multikey_3", "niah", haystack="needles", key_kind="uuid",
              value_kind="uuid"),
    RulerTask("niah_multivalue", "niah", haystack="text", values=4),
    RulerTask("niah_multiquery", "niah", haystack="text", keys=4, queries=4),
    RulerTask("vt", "vt", keys=5),
    RulerTask("cwe", "cwe"),
    RulerTask("fwe", "fwe", top=3),
)}
"""The suite `ruler`, in its order."""

TEXT_HAYSTACK = tuple(name for name, t in RULER_TASKS.items() if t.haystack == "text")
"""The tasks whose haystack is real text (the validation documents)."""


def ruler_tasks(tasks: list[str]) -> list[str]:
    """The RULER-style tasks `eval.tasks` names (the suite expanded), in the suite's order."""
    named = set(tasks) | (set(RULER_TASKS) if RULER_SUITE in tasks else set())
    return [name for name in RULER_TASKS if name in named]
