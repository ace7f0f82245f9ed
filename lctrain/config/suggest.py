"""The arithmetic of the fixes the configuration rules suggest: the divisors a size may take,
the nearest multiple a size should round to."""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_multiple(x: int, m: int) -> int:
    """The multiple of m closest to x (ties go up), never below m."""
    return max(m, (x + m // 2) // m * m)
