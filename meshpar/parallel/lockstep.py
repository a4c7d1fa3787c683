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
from meshpar.core.hlo import device_groups

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
    """The device-id groups of one collective instruction's line (every device when it names none,
    or names them in a form not read: the reading that refuses rather than hangs)."""
    groups = device_groups(line)
    if op == "collective-permute":
        return groups or []
    return groups or [list(range(n))]
