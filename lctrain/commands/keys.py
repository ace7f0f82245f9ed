"""`lctrain keys [SECTION ...]`: every configuration key (or those of the sections named) with
its type, default, allowed values and meaning, from the schema."""

from __future__ import annotations

import textwrap

from lctrain.commands import CommandArgs
from lctrain.config import ConfigError
from lctrain.config.keys import keys, sections


def run(args: CommandArgs) -> int:
    names = args.words
    unknown = [n for n in names if n not in sections()]
    if unknown:
        raise ConfigError([f"unknown section {n!r}; the sections are {', '.join(sections())}"
                           for n in unknown])
    for section in names or [None]:
        for key in keys(section):
            allowed = f"  [{key.allowed}]" if key.allowed else ""
            print(f"{key.name}: {key.type} = {key.default!r}{allowed}")
            if key.doc:
                print(textwrap.fill(key.doc, 96, initial_indent="    ",
                                    subsequent_indent="    "))
            for name, summary in key.registered:
                print(textwrap.fill(f"{name}: {summary}", 96, initial_indent="      ",
                                    subsequent_indent="        "))
    return 0
