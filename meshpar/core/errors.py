"""User-facing errors: one line that names the thing at fault and, where possible, a fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MeshparError(Exception):
    """A configuration or input problem the user can fix. The CLI prints it as one line, no traceback."""


class ConfigError(MeshparError):
    """A config key or value is wrong."""


class ShardingError(MeshparError):
    """A logical axis, rule or mesh axis does not fit the tensor it is asked to shard."""


def suggest(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """' (did you mean 'x'?)' for the closest choice, or a list of valid choices if none is close;
    `prefix` leads each one named (a config section: 'mesh.' -> 'mesh.tensor', the key to type)."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f" (choose from: {', '.join(prefix + c for c in choices)})"
