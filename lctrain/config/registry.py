"""A registry: the entries of a choice that grows, by name, in registration order.

A registry is also the live list of allowed values of the schema field it backs
(`fields.one_of(registry=...)`): validation, `lctrain keys` and the layers that dispatch on the
name all read it when they run, so registering an entry is the one step that makes a name valid
everywhere. `registered` undoes itself (tests add toy entries without leaking them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> entry, in registration order; iterating yields the names. Each entry has a `name`
    attribute."""

    def __init__(self, what: str):
        self.what = what
        """What an entry is, for error messages ("context-parallel attention algorithm")."""
        self._entries: dict[str, T] = {}

    def add(self, entry: T) -> T:
        name = entry.name  # type: ignore[attr-defined]
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered already")
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> T:
        return self._entries.pop(name)

    @contextlib.contextmanager
    def registered(self, entry: T) -> Iterator[T]:
        """`entry` registered inside the block, removed after it."""
        self.add(entry)
        try:
            yield entry
        finally:
            self.remove(entry.name)  # type: ignore[attr-defined]

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.what} {name!r}; registered: "
                           f"{', '.join(self._entries)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[T]:
        return list(self._entries.values())

    def __repr__(self) -> str:
        return f"Registry({self.what}: {', '.join(self._entries)})"
