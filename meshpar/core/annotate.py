"""The resolved config as YAML that `--config` reads back, every key with the comment beside its
field in `meshpar.core.config.schema` (meaning, allowed values): what `meshpar config` prints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from meshpar.core.config import Config
from meshpar.core.config import schema as config_lib


def field_comments() -> dict[tuple[str, str], str]:
    """{(class, field): the comment beside that field in meshpar.core.config.schema}: the meaning of every
    key. A comment goes on across the comment-only lines that follow its field."""
    import ast
    import io
    import tokenize

    src = Path(config_lib.__file__).read_text()
    notes = {
        t.start[0]: t.string[1:].strip()
        for t in tokenize.generate_tokens(io.StringIO(src).readline)
        if t.type == tokenize.COMMENT
    }
    lines = src.splitlines()
    out = {}
    for c in ast.parse(src).body:
        if not isinstance(c, ast.ClassDef):
            continue
        for s in c.body:
            if not isinstance(s, ast.AnnAssign) or not isinstance(s.target, ast.Name):
                continue
            end = s.end_lineno or s.lineno
            parts = [notes[n] for n in range(s.lineno, end + 1) if n in notes]
            n = end + 1
            while n in notes and lines[n - 1].lstrip().startswith("#"):
                parts.append(notes[n])
                n += 1
            if parts:
                out[(c.name, s.target.id)] = " ".join(parts)
    return out


def annotated_yaml(cfg: Config) -> str:
    """`meshpar config`: the resolved config as YAML that `--config` reads back, every key with its
    comment (meaning, allowed values) and every section with its docstring's first line."""
    comments = field_comments()

    def scalar(v) -> str:
        return yaml.safe_dump(v, default_flow_style=True, width=1 << 20).split("\n...")[0].strip()

    def emit(obj, indent: str) -> list[str]:
        out = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                doc = (type(v).__doc__ or "").strip().splitlines()[0]
                out += [f"{indent}{f.name}:  # {doc}", *emit(v, indent + "  ")]
                continue
            line, note = f"{indent}{f.name}: {scalar(v)}", comments.get((type(obj).__name__, f.name))
            out.append(f"{line:<36}  # {note}" if note else line)
        return out

    return "\n".join(emit(cfg, "")) + "\n"
