"""The schema's field helpers: a field with its allowed values beside it (`one_of`,
`each_one_of`, `at_least`), kept in the field's metadata, where `lctrain.config.validation`
checks them and `lctrain keys` lists them."""

from __future__ import annotations

from dataclasses import field, fields

from lctrain.config.registry import Registry


class _WithRegistry:
    """Fixed choices followed by a registry's names, read when asked (`in`, iteration)."""

    def __init__(self, fixed: tuple[str, ...], registry: Registry):
        self.fixed, self.registry = fixed, registry

    def __iter__(self):
        return iter((*self.fixed, *self.registry))

    def __contains__(self, name: object) -> bool:
        return name in self.fixed or name in self.registry


def one_of(*choices: str, default: str | None = None, registry: Registry | None = None):
    """A string field whose value must be one of `choices` (the first is the default), and with
    a `registry` one of the names in it when it is read (a choice that grows:
    docs/extending.md); a registry field without fixed choices names its default."""
    if registry is not None:
        assert choices or default is not None, "a registry field names its default"
        return field(default=choices[0] if default is None else default,
                     metadata={"choices": _WithRegistry(choices, registry)})
    return field(default=choices[0] if default is None else default,
                 metadata={"choices": choices})


def each_one_of(*choices: str, default: tuple[str, ...] = ()):
    """A list field whose every element must be one of `choices`."""
    return field(default_factory=lambda: list(default), metadata={"choices": choices})


def at_least(minimum: int, default, hint: str | None = None):
    """A number field that must be >= `minimum` (None allowed for optional fields); `hint` is
    the fix the error message suggests instead of `key=minimum`."""
    return field(default=default, metadata={"min": minimum, "hint": hint})


def choices_of(schema: type, name: str) -> tuple[str, ...]:
    """The allowed values of field `name` of the dataclass `schema` (a registry's, now)."""
    return tuple(next(f for f in fields(schema) if f.name == name).metadata["choices"])
