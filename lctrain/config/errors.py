"""ConfigError: every problem of a configuration, raised by composition, validation and the
commands, and turned into exit code 2 by `lctrain.cli` alone."""

from __future__ import annotations


class ConfigError(Exception):
    """A configuration (or launch environment) that cannot run; `problems` lists each one with
    the key, its value and a fix."""

    def __init__(self, problems: list[str], header: str = "invalid configuration"):
        self.problems, self.header = list(problems), header
        super().__init__(f"{header}: " + "; ".join(self.problems))
