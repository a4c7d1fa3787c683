"""What a compiler's own dumps say of a program's temporaries: the values live at its peak
(`*-live-range.txt`) and the slots they occupy in its temporary allocation (`*-buffer-assignment.txt`).

XLA's live-range view counts values. Its buffer assignment can give two of them one slot: a fusion
that writes its output over its input, such as the cross-entropy's cotangent over the logits. Both
are then "live at the peak" in the first dump and share one slot in the second. `peak_buffers`
names the value whose slot another one holds, so the same bytes are not read as twice.
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
_ALLOCATION = re.compile(r"^allocation (\d+):")
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


def peak_buffers(live_range: str, hlo: str, top: int = 8, assignment: str | None = None) -> list[dict]:
    """The buffers the compiler itself found live at its peak, largest first (its `*-live-range.txt`
    dump, read beside the optimized HLO `hlo` for each buffer's shape, opcode and JAX op name):
    [{"name", "bytes", "shape", "opcode", "op_name"}], and "slot_of": the larger buffer whose slot it
    shares, where the buffer `assignment` says so (its bytes are that buffer's). The entry's
    parameters (the train state, counted as arguments) and aliases of other buffers are left out:
    these are the temporaries a change to the program moves. Their sum can be below
    `memory_analysis()`'s temp, the packed allocation of every temporary over the whole program."""
    info = {}
    for line in hlo.splitlines():
        name, shape = _NAME.match(line), _SHAPE.search(line)
        if name and shape:
            tup = _TUPLE.search(line)
            shapes = _SHAPES.findall(tup.group(1)) if tup else [shape.group(1)]  # a tuple's elements, in order
            opcode, op = _OPCODE.search(line, tup.end(1) if tup else shape.end()), _OP_NAME.search(line)
            info[name.group(1)] = (shapes, opcode.group(1) if opcode else "?", op.group(1) if op else "")
    out, reading = [], False
    for line in live_range.splitlines():
        if _PEAK.match(line):
            reading = True
            continue
        m = _LIVE.match(line) if reading else None
        if reading and not m:
            break
        if m:
            shapes, opcode, op = info.get(m.group(1), (["?"], "?", ""))
            if opcode in _ALIASES or m.group(1).startswith(("param", "constant")):
                continue
            index = int(m.group(2).split(",")[0]) if m.group(2) else 0
            shape = shapes[index] if index < len(shapes) else "?"
            out.append(
                {
                    "name": m.group(1),
                    "key": f"{m.group(1)}{{{m.group(2)}}}",
                    "bytes": int(m.group(3)),
                    "shape": shape,
                    "opcode": opcode,
                    "op_name": op,
                }
            )
    out.sort(key=lambda b: -b["bytes"])
    where = slots(assignment) if assignment else {}
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
