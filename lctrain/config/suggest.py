"""The fixes the configuration rules suggest: the divisors a size may take, the nearest
multiple a size should round to, the known name a mistyped one is closest to."""

from __future__ import annotations

import difflib


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_multiple(x: int, m: int) -> int:
    """The multiple of m closest to x (ties go up), never below m."""
    return max(m, (x + m // 2) // m * m)


def did_you_mean(name: str, known, prefix: str = "") -> str:
    """ " (did you mean X?)" for the known names closest to a mistyped `name` (those as close as
    the closest, in their given order; "X or Y" when two tie), each after `prefix`, else ""."""
    scores = {k: difflib.SequenceMatcher(None, name, k).ratio() for k in known}
    best = max(scores.values(), default=0.0)
    if best < 0.6:
        return ""
    return f" (did you mean {' or '.join(prefix + k for k, v in scores.items() if v == best)}?)"
