"""User-facing errors: one line that names the thing at fault and, where possible, a fix; and
`user_code`, the one boundary around user code (factories, losses, data sources) that turns what it
raises into the user's own frames and one line saying what meshpar was doing."""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import traceback
from collections.abc import Iterable, Iterator


class MeshparError(Exception):
    """A configuration or input problem the user can fix. The CLI prints it as one line, no traceback."""


class ConfigError(MeshparError):
    """A config key or value is wrong."""


class ShardingError(MeshparError):
    """A logical axis, rule or mesh axis does not fit the tensor it is asked to shard."""


class UserCodeError(MeshparError):
    """An exception raised in the user's code (a model factory, a loss, a data source, a module
    imported by name) while meshpar was `doing` something. Its message is one line, `doing: Type:
    message`; `trace` holds the frames of the user's own files (most recent call last), which the CLI
    prints above that line. The original exception is its `__cause__`."""

    def __init__(self, doing: str, error: BaseException, frames: list[traceback.FrameSummary]):
        self.doing, self.error = doing, error
        message = " ".join(str(error).split())  # one line (JAX's messages run over several)
        super().__init__(f"{doing}: {type(error).__name__}" + (f": {message}" if message else ""))
        self.trace = "".join(["meshpar: in your code (most recent call last):\n", *traceback.format_list(frames)])


@contextlib.contextmanager
def user_code(doing: str) -> Iterator[None]:
    """Run user code, saying what meshpar is `doing` ("building model.name=pkg.mod:fn") if it raises.

    An exception raised in, or passing through, a frame of the user's own files becomes a
    `UserCodeError` (exit status 2 at the CLI, the user's frames and one line); one raised only in
    meshpar's or its libraries' frames (a bug of theirs) goes on untouched, and so does a
    `MeshparError` (already one line: the innermost `user_code` decides)."""
    try:
        yield
    except MeshparError:
        raise
    except Exception as e:
        frames = user_frames(e)
        if not frames:
            raise
        raise UserCodeError(doing, e, frames) from e


def user_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames of `error`'s traceback that lie in the user's files (not meshpar's, its
    libraries' or Python's own); a SyntaxError in a user's file counts as a frame at its line."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _is_user_file(f.filename)]
    if isinstance(error, SyntaxError) and error.filename and _is_user_file(error.filename):
        frames.append(traceback.FrameSummary(error.filename, error.lineno or 0, "<module>", line=error.text or ""))
    return frames


# meshpar (its reference models are installed as meshpar.models from models/) and the libraries it runs
# user code through, with theirs: their frames are not the user's (another library's, which user code
# called, are shown)
INTERNAL_PACKAGES = (
    "meshpar",
    "meshpar.models",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "numpy",
    "orbax",
    "ml_dtypes",
    "chex",
    "treescope",
    "opt_einsum",
    "scipy",
    "absl",
    "etils",
    "typing_extensions",
    "yaml",
    "rich",
    "tensorstore",
    "msgpack",
)


@functools.cache
def _roots() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(INTERNAL_PACKAGES' folders, the folders packages install into, Python's own library), each a
    realpath ending in a separator."""
    import importlib.util
    import sysconfig

    def folders(paths) -> tuple[str, ...]:
        return tuple(os.path.join(os.path.realpath(p), "") for p in paths if p)

    packages = []
    for name in INTERNAL_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            packages += spec.submodule_search_locations or []
    paths = sysconfig.get_paths()
    return folders(packages), folders({paths["purelib"], paths["platlib"]}), folders({paths["stdlib"]})


def _is_user_file(path: str) -> bool:
    """A Python file of the user's: one on disk (not <frozen importlib._bootstrap>, <string>, nor a
    compiled extension's relative source name) outside meshpar, its libraries and Python's own
    library (a package the user installed counts, wherever site-packages lies)."""
    if not path or path.startswith("<") or not os.path.isfile(path):
        return False
    packages, installed, stdlib = _roots()
    real = os.path.realpath(path)
    if real.startswith(packages):
        return False
    return real.startswith(installed) or not real.startswith(stdlib)  # a package of the user's, installed


def suggest(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """' (did you mean 'x'?)' for the closest choice, or a list of valid choices if none is close;
    `prefix` leads each one named (a config section: 'mesh.' -> 'mesh.tensor', the key to type)."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f" (choose from: {', '.join(prefix + c for c in choices)})"
