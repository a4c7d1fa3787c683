"""Output paths named on the command line (`--metrics-out`, `plan --out`, `export --out`, `plot -o`),
checked before any work: one line naming the flag and the folder at fault, so a run never fails
after compiling (or training) because it cannot open the file it was asked to write."""

from __future__ import annotations

import os
from pathlib import Path

from meshpar.core.errors import MeshparError


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def check_output_file(flag: str, path: str) -> None:
    """A file the command will write: its folder exists, is a folder and is writable; it is not a folder."""
    p = Path(path).expanduser()
    folder = p.parent
    if p.is_dir():
        raise MeshparError(f"{flag} {path}: that is a folder; name a file (e.g. {p / 'out'})")
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise MeshparError(f"{flag} {path}: the folder {folder} {what}; create it or choose another path")
    if not _writable(folder):
        raise MeshparError(f"{flag} {path}: the folder {folder} is not writable; choose another path")


def check_output_dir(flag: str, path: str) -> None:
    """A folder the command will write into, or create in a folder that exists (as for a file, a
    missing parent folder is refused, not created): not a file, and writable."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise MeshparError(f"{flag} {path}: that is a file, not a folder; choose a folder")
    if p.is_dir():
        if not _writable(p):
            raise MeshparError(f"{flag} {path}: the folder is not writable; choose another path")
        return
    folder = p.parent
    if folder.exists() and not folder.is_dir():
        raise MeshparError(f"{flag} {path}: {folder} is a file, not a folder; choose another path")
    if not folder.is_dir():
        raise MeshparError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another path")
    if not _writable(folder):
        raise MeshparError(f"{flag} {path}: cannot be created: {folder} is not writable; choose another path")
