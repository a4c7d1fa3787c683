"""What a compiler's own dumps say of a program's temporaries: the values live at its peak
(`*-live-range.txt`) and the slots they occupy in its temporary allocation (`*-buffer-assignment.txt`).

XLA's live-range view counts values. Its buffer assignment can give two of them one slot: a fusion
that writes its output over its input, such as the cross-entropy's cotangent over the logits. Both
are then "live at the peak" in the first dump and share one slot in the second. `peak_buffers`
names the value whose slot another one holds, so the same bytes are not read as twice.

The live-range dump's own "peak" line does not count a value that dies at the instruction that
defines another: the two are taken to share memory. Where the compiler gave them two slots (libtpu's
logits and their cotangent, 2 x 500 MiB for 125m fsdp on 8 v5p chips) both are held at that instant,
and the heap's peak is there, not at the dump's line. `peak_instant` finds it from the slots.
"""

from __future__ import annotations

import re

# names for a buffer another instruction defined (a loop's or fusion's parameter, a tuple's element)
_ALIASES = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):\s*$")
_LIVE = re.compile(r"^\s*([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")
_SHAPE = re.compile(r"=\s*\(?([a-z]\w*\[[\d,]*\])")
_SHAPES = re.compile(r"[a-z]\w*\[[\d,]*\]")
_TUPLE = re.compile(r"=\s*\((.*?)\)\s+[a-z][\w\-]*\(")
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ALLOCATION = re.compile(r"^allocation (\d+): size \d+(.*)$")
_RANGE = re.compile(r"^\s+([\w.\-]+\{[\d,]*\}):(\d+)-(\d+)$", re.M)
_VALUE = re.compile(r"^\s*value: <\d+ ([\w.\-]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")


def slots(assignment: str) -> dict[str, tuple[int, int, int]]:
    """Value ('name{}', 'name{1}' for a tuple's element 1, as the live ranges write it) -> (allocation,
    offset, size) in the compiler's buffer assignment."""
    out, alloc = {}, -1
    for line in assignment.splitlines():
        a = _ALLOCATION.match(line)
        if a:
            alloc = int(a.group(1))
            continue
        v = _VALUE.match(line)
        if v:
            out[v.group(1) + (v.group(2) or "{}")] = (alloc, int(v.group(4)), int(v.group(3)))
    return out


def _device_memory(assignment: str) -> set[int]:
    """The allocations a step's arguments, outputs and temporaries take in device memory: not its
    constants or thread-local scratch, and in the default memory space."""
    out = set()
    for line in assignment.splitlines():
        a = _ALLOCATION.match(line)
        if a and not any(w in a.group(2) for w in ("constant", "thread-local", "color")):
            out.add(int(a.group(1)))
    return out


def _held(live: list[tuple[int, int, int]]) -> int:
    """Bytes the slots (allocation, offset, size) cover together: a shared or overlapping slot once."""
    total, alloc, end = 0, None, 0
    for a, start, size in sorted(live):
        if a != alloc:
            alloc, end = a, 0
        if start + size > end:
            total += start + size - max(start, end)
            end = start + size
    return total


def peak_instant(live_range: str, assignment: str) -> tuple[int, int] | None:
    """(instant, bytes): the instruction index of the live-range dump at which the slots of the values
    live together cover the most bytes of device memory in the buffer `assignment` (the arguments
    until they die or are updated in place, the outputs and the temporaries), and those bytes. A value
    is live from the instruction that defines it to its last use, both included. The bytes are the
    compiler's own peak: XLA:GPU's `peak_memory_in_bytes` to 0.01% (125m on one H100: 2,603.7 MiB);
    libtpu's counts more than its dumps show, 0.3% more for 125m fsdp on 8 v5p chips (1,490.6 of
    1,495.0 MiB), up to 6% more for tiny programs."""
    import numpy as np

    where, kept = slots(assignment), _device_memory(assignment)
    spans = [(int(a), int(b), where[k]) for k, a, b in _RANGE.findall(live_range) if where.get(k, (-1,))[0] in kept]
    if not spans:
        return None
    starts, ends = np.array([s[0] for s in spans]), np.array([s[1] for s in spans])
    sizes = np.array([s[2][2] for s in spans])
    best, at = -1, 0
    for t in np.unique(starts):  # the bytes held only grow where a value begins
        live = (starts <= t) & (t <= ends)
        if sizes[live].sum() <= best:  # the sum bounds the union: this instant cannot beat the best
            continue
        held = _held([spans[i][2] for i in np.flatnonzero(live)])
        if held > best:
            best, at = held, int(t)
    return at, best


def peak_buffers(
    live_range: str, hlo: str, top: int = 8, assignment: str | None = None, instant: int | None = None
) -> list[dict]:
    """The buffers live at the compiler's peak, largest first: at `peak_instant` where the buffer
    `assignment` is given, else at its `*-live-range.txt` dump's own peak line; read beside the
    optimized HLO `hlo` for each buffer's shape, opcode and JAX op name:
    [{"name", "bytes", "shape", "opcode", "op_name"}], and "slot_of": the larger buffer whose slot it
    shares, where the buffer `assignment` says so (its bytes are that buffer's); `instant`:
    `peak_instant`'s, where the caller has it. The entry's parameters (the train state, counted as
    arguments) and aliases of other buffers are left out: these are the temporaries a change to the
    program moves. Their sum can be below `memory_analysis()`'s temp, the packed allocation of every
    temporary over the whole program."""
    info = {}
    for line in hlo.splitlines():
        name, shape = _NAME.match(line), _SHAPE.search(line)
        if name and shape:
            tup = _TUPLE.search(line)
            shapes = _SHAPES.findall(tup.group(1)) if tup else [shape.group(1)]  # a tuple's elements, in order
            opcode, op = _OPCODE.search(line, tup.end(1) if tup else shape.end()), _OP_NAME.search(line)
            info[name.group(1)] = (shapes, opcode.group(1) if opcode else "?", op.group(1) if op else "")
    where = slots(assignment) if assignment else {}
    if instant is None and assignment:
        peak = peak_instant(live_range, assignment)
        instant = peak[0] if peak else None
    if instant is not None:  # the values live at the heap's peak, each its slot's bytes
        live = [
            (k, where[k][2]) for k, a, b in _RANGE.findall(live_range) if int(a) <= instant <= int(b) and k in where
        ]
    else:  # the dump's own peak line
        live, reading = [], False
        for line in live_range.splitlines():
            if _PEAK.match(line):
                reading = True
                continue
            m = _LIVE.match(line) if reading else None
            if reading and not m:
                break
            if m:
                live.append((f"{m.group(1)}{{{m.group(2)}}}", int(m.group(3))))
    out = []
    for key, nbytes in live:
        name, index = key[: key.index("{")], key[key.index("{") + 1 : -1]
        shapes, opcode, op = info.get(name, (["?"], "?", ""))
        if opcode in _ALIASES or name.startswith(("param", "constant")):
            continue
        i = int(index.split(",")[0]) if index else 0
        shape = shapes[i] if i < len(shapes) else "?"
        out.append({"name": name, "key": key, "bytes": nbytes, "shape": shape, "opcode": opcode, "op_name": op})
    out.sort(key=lambda b: -b["bytes"])
    held: list[tuple[tuple[int, int, int], str]] = []
    for b in out:
        slot = where.get(b.pop("key"))
        if slot is None:
            continue
        for (alloc, at, size), name in held:
            if alloc == slot[0] and at < slot[1] + slot[2] and slot[1] < at + size:
                b["slot_of"] = name
                break
        else:
            held.append((slot, b["name"]))
    return out[:top]


def at_peak(live_range: str | None, hlo: str, assignment: str | None) -> tuple[list[dict] | None, int | None]:
    """`inspect --target`'s view of the dumps: (`peak_buffers`, the bytes `peak_instant` finds held
    there, the compiler's own peak); None for what the compiler did not dump."""
    if not live_range:
        return None, None
    peak = peak_instant(live_range, assignment) if assignment else None
    instant, held = peak if peak else (None, None)
    return peak_buffers(live_range, hlo, assignment=assignment, instant=instant), held
