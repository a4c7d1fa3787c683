"""Which devices an XLA collective joins, read from one instruction of compiled HLO text.

XLA prints a collective's replica groups in three notations, by version and pass:
- explicit: `replica_groups={{0,1},{2,3}}` (`{}`: one group of every device);
- iota: `replica_groups=[G,S]<=[dims]T(perm)`: arange over dims, transposed, cut into G groups of S;
- by mesh axes (jaxlib 0.11, Shardy): `replica_groups=mesh['data'=2,'context'=2] {'context'}`, a
  group per coordinate of the axes not named, over the named ones; a sub-axis `'data':(pre)size` is
  the factor of `data` after `pre` (Shardy's split of an axis, major first), and a mesh whose devices
  are not in order carries `, device_ids=(...)` (`[dims]T(perm)`, or the ids listed).
A collective-permute names `source_target_pairs={{0,1},{1,0}}` instead. Ids are positions in the
program's device assignment (for meshpar's programs, in the mesh's device array, row-major)."""

from __future__ import annotations

import math
import re

import numpy as np

_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LISTED = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,{} ]*\})\}")


def device_groups(line: str) -> list[list[int]] | None:
    """The device-id groups one collective instruction's line names (a permute: its [source, target]
    pairs); None where it names none (`{}`: every device) or in a form this does not read."""
    m = _MESH.search(line)
    if m:
        return _by_mesh_axes(*m.groups())
    m = _IOTA.search(line)
    if m:
        return _iota(m.group(2), m.group(3)).reshape([int(x) for x in m.group(1).split(",")]).tolist()
    m = _LISTED.search(line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d, ]*)\}", m.group(1))] or None
    return None


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """arange over `dims` ("2,2,2"), transposed by `perm` ("1,0,2") when given."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _read(pattern: str, text: str) -> re.Match:
    """`pattern` matched against all of `text`; ValueError where it does not match."""
    m = re.fullmatch(pattern, text.strip())
    if m is None:
        raise ValueError(text)
    return m


def _by_mesh_axes(axes: str, device_ids: str | None, named: str) -> list[list[int]] | None:
    """Groups of `mesh[axes], device_ids=(device_ids) {named}`; None where the text is not read."""
    axis = r"""['"]?([\w.\-]+)['"]?"""
    try:
        mesh = [(m.group(1), int(m.group(2))) for m in (_read(axis + r"=(\d+)", a) for a in axes.split(","))]
        refs = [_read(axis + r"(?::\((\d+)\)(\d+))?", r).groups() for r in named.split(",") if r.strip()]
        if any(ref not in dict(mesh) for ref, _, _ in refs):
            raise ValueError(named)  # an axis the mesh does not name
        if device_ids is None:
            ids = np.arange(math.prod(size for _, size in mesh))
        elif "[" in device_ids:  # [dims]T(perm), or [dims]<=[iota dims]T(perm)
            m = _read(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", device_ids)
            ids = _iota(m.group(2) or m.group(1), m.group(3)).ravel()
        else:
            ids = np.array([int(d) for d in _read(r"[\d,\s]+", device_ids).group(0).split(",")])
        # each axis cut where a named sub-axis starts or ends: the factors of its size, major first
        dims, picked = [], []
        for name, size in mesh:
            subs = [(int(pre), int(pre) * int(sub)) for ref, pre, sub in refs if ref == name and pre]
            whole = any(ref == name and not pre for ref, pre, _ in refs)
            cuts = sorted({1, size, *(c for span in subs for c in span)})
            for lo, hi in zip(cuts, cuts[1:]):
                dims.append(hi // lo)
                picked.append(whole or any(a <= lo and hi <= b for a, b in subs))
        ids = ids.reshape(dims)
        order = [i for i, p in enumerate(picked) if not p] + [i for i, p in enumerate(picked) if p]
        width = math.prod(d for d, p in zip(dims, picked) if p)
        return ids.transpose(order).reshape(-1, width).tolist()
    except ValueError:
        return None
