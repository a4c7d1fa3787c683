"""Collectives the pipeline's stages would wait in apart: a compiled pipelined program is read before
it runs, and one that would deadlock is refused in one line.

Inside the pipeline's shard_map the stages take different branches of a conditional at the same
tick (1F1B's `lax.switch` on the stage index, GPipe's `cond` on the first and last stage). A
collective inside such a branch is reached only by the devices that take that branch; when its
participants include a device of another stage, that device is waiting in another collective, or
in none: every device waits forever (XLA:CPU gives up after its termination timeout and aborts the
whole process, `rendezvous.cc ... Exiting to ensure a consistent program state`). XLA's SPMD
partitioner places such collectives by itself when it reshards a value inside a branch, over a mesh
axis that is automatic inside the shard_map (`data`, `tensor`).

Who takes part, by the compiled HLO's device ids (positions in the mesh's device array; the stage of
id i is its index along `pipeline`):
- all-reduce, all-gather, reduce-scatter, all-to-all (and their `-start` forms): each replica group
  (`{{0,1},{2,3}}` or the iota form `[4,2]<=[2,2,2]T(0,2,1)`; none: every device);
- collective-permute: every device of the program on XLA:CPU, whose rendezvous waits for all of them
  whatever its source-target pairs (observed: pairs inside one stage each, a wait for all 8 devices);
  elsewhere the devices of each pair.
Conditionals count when they sit in the shard_map (their op name says so) or carry no op name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from meshpar.core.errors import ConfigError

AXIS = "pipeline"
_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = .+? ([a-z][a-z\-]*)\(")
_CALLEE = re.compile(r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_BRANCHES = re.compile(
    r"\b(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)|"
    r"false_computation=%?([\w.\-]+))"
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclass(frozen=True)
class Stray:
    """A collective inside a stage's branch whose participants span stages."""

    op: str  # "collective-permute", "all-reduce", ...
    op_name: str  # JAX's name for the operation it came from ("" if the HLO has none)
    devices: tuple  # the participants of the first group that spans stages
    stages: tuple  # their stages


def stage_of(mesh) -> np.ndarray:
    """Each device id's (position in `mesh.devices`) pipeline stage: [N] ints."""
    return np.indices(mesh.devices.shape)[list(mesh.axis_names).index(AXIS)].ravel()


def strays(hlo: str, stages: np.ndarray, permute_joins_all: bool) -> list[Stray]:
    """The collectives of compiled HLO text `hlo` that sit in a stage-dependent conditional's branch
    (or anything it calls) and join devices of different stages; `stages` [N]: each device id's
    stage (`stage_of`); `permute_joins_all`: a collective-permute waits for every device (XLA:CPU)."""
    bodies = _computations(hlo)
    inside = _in_branches(bodies)
    found = []
    for name in inside:
        for line in bodies.get(name, ()):
            m = _INSTRUCTION.match(line)
            op = m and m.group(1).removesuffix("-start")
            if op not in _OPS:
                continue
            groups = (
                [list(range(len(stages)))]
                if op == "collective-permute" and permute_joins_all
                else _participants(line, op, len(stages))
            )
            for group in groups:
                if len({int(stages[d]) for d in group}) > 1:
                    where = _OP_NAME.search(line)
                    found.append(
                        Stray(
                            op,
                            where.group(1) if where else "",
                            tuple(group),
                            tuple(sorted({int(stages[d]) for d in group})),
                        )
                    )
                    break
    return found


def check(hlo: str, mesh, what: str, platform: str, schedule: str) -> None:
    """Raise ConfigError (one line) when the compiled pipelined program `hlo` on `mesh` would
    deadlock; `what` names the run ("pipeline.schedule=1f1b on mesh pipeline=2 data=2 tensor=2 with
    strategy=fsdp"), `platform` its devices' ("cpu", "gpu", "tpu"), `schedule` its pipeline.schedule."""
    found = strays(hlo, stage_of(mesh), platform == "cpu")
    if not found:
        return
    s = found[0]
    source = s.op_name.split("/shard_map/")[-1] or "an operation without a name"
    devices = f"all {len(s.devices)} devices" if len(s.devices) == mesh.devices.size else f"devices {list(s.devices)}"
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise ConfigError(
        f"{what} compiled to a program that would deadlock: XLA placed a {s.op} over {devices} (pipeline stages "
        f"{', '.join(map(str, s.stages))}) inside a branch that only some stages take at a tick, from {source}"
        f"{more}; the stages would wait in different collectives (XLA:CPU then aborts the process). Try "
        + (
            "pipeline.schedule=gpipe (it runs the stacked layers outside any branch) or another strategy"
            if schedule == "1f1b"
            else "another strategy or mesh"
        )
    )


# ----------------------------------------------------------------------------------------------
# HLO text: computations, the calls between them, replica groups.


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO module text -> {computation name: its instruction lines}."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{") and "->" in line:
            name = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
            current = bodies.setdefault(name, [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return bodies


def _names(text: str) -> list[str]:
    return [n.strip().lstrip("%") for n in text.split(",") if n.strip()]


def _in_branches(bodies: dict[str, list[str]]) -> set[str]:
    """Names of the computations run inside a stage-dependent conditional's branch, and all they call."""
    todo = []
    for lines in bodies.values():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or m.group(1) != "conditional":
                continue
            where = _OP_NAME.search(line)
            if where is None or "shard_map" in where.group(1):
                for groups in _BRANCHES.findall(line):
                    todo += [n for g in groups if g for n in _names(g)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in bodies.get(name, ()):
            todo += _CALLEE.findall(line) + [n for g in _CALLEES.findall(line) for n in _names(g)]
    return seen


def _participants(line: str, op: str, n: int) -> list[list[int]]:
    """The device-id groups of one collective instruction's line (every device when it names none)."""
    if op == "collective-permute":
        m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1) + "}")] if m else []
    m = _MESH_GROUPS.search(line)
    if m:
        return _mesh_groups(*m.groups()) or [list(range(n))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        return _iota(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    groups = [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))] if m else []
    return [g for g in groups if g] or [list(range(n))]


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list `<=[dims]T(perm)`: arange over dims, transposed by perm."""
    ids = np.arange(int(np.prod([int(d) for d in dims.split(",")]))).reshape([int(d) for d in dims.split(",")])
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?\s*\{([^}]*)\}")
_AXIS_REF = re.compile(r"^['\"]?([\w.\-]+)['\"]?(?::\((\d+)\)(\d+))?$")


def _mesh_groups(axes: str, device_ids: str | None, grouped: str) -> list[list[int]] | None:
    """Replica groups in the form jaxlib 0.11 prints for a collective over named mesh axes:
    `mesh['pipeline'=2,'data'=2,'context'=2] {'context'}` (optionally `, device_ids=(...)` after the
    mesh, and sub-axes `'data':(pre)size`): one group per coordinate of the axes not named, over the
    named ones. None where the text is not understood (the caller then assumes every device)."""
    try:
        mesh = [
            (_AXIS_REF.match(a.rsplit("=", 1)[0].strip()).group(1), int(a.rsplit("=", 1)[1])) for a in axes.split(",")
        ]
        refs = [_AXIS_REF.match(r.strip()).groups() for r in grouped.split(",") if r.strip()]
        n = int(np.prod([size for _, size in mesh]))
        if device_ids is None:
            ids = np.arange(n)
        elif "<=" in device_ids:
            m = re.fullmatch(r"\s*\[[\d,]+\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", device_ids)
            ids = _iota(m.group(1), m.group(2)).ravel()
        else:
            ids = np.array([int(d) for d in re.findall(r"\d+", device_ids)])
        # each mesh axis cut where a named sub-axis starts or ends: factors of its size, major first
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
        width = int(np.prod([d for d, p in zip(dims, picked) if p]))
        return ids.transpose(order).reshape(-1, width).tolist()
    except (AttributeError, ValueError, TypeError):
        return None
