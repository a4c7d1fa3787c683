"""Look inside a compiled step: collectives in the HLO, memory per device, FLOPs, the sharding table.

Collectives are read from the optimized HLO text. Each op's `bytes` is the size of the *whole*
tensor it moves (the larger of operand and result: the gathered tensor of an all-gather, the
pre-scatter tensor of a reduce-scatter), so an all-reduce and the all-gather + reduce-scatter pair
that replaces it under sequence parallelism compare directly. Ops inside a `while` body (scanned
layers, gradient accumulation) are multiplied by the loop's known trip count: numbers are per step.
Replica groups are mapped back to the mesh axes they span.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\((.*)$")


def _bytes(text: str) -> int:
    return sum(_DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _SHAPE.findall(text))


def _split_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if cur is not None:
            if line.strip() == "}":
                cur = None
            else:
                comps[cur].append(line)
    return comps, entry


def _multipliers(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of ENTRY (while bodies x trip count)."""
    calls = defaultdict(list)   # caller -> [(callee, times)]
    for name, lines in comps.items():
        for line in lines:
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            body = re.search(r"body=%?([\w.\-]+)", line)
            if body:
                calls[name].append((body.group(1), int(trip.group(1)) if trip else 1))
            for key in ("calls", "to_apply_unused", "true_computation", "false_computation"):
                for m in re.finditer(key + r"=%?([\w.\-]+)", line):
                    calls[name].append((m.group(1), 1))
            br = re.search(r"branch_computations=\{([^}]*)\}", line)
            if br:
                for c in br.group(1).split(","):
                    calls[name].append((c.strip().lstrip("%"), 1))
    mult: dict[str, int] = defaultdict(int)

    def visit(name, times, depth=0):
        if depth > 50:
            return
        mult[name] += times
        for callee, t in calls.get(name, []):
            if callee in comps:
                visit(callee, times * t, depth + 1)

    if entry:
        visit(entry, 1)
    return mult


def _groups(line: str) -> list[list[int]] | None:
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d, ]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{(\{[\d,{} ]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d, ]*)\}", m.group(1))]
    return None


def _axes_of_groups(groups, mesh_shape: dict[str, int]) -> list[str]:
    """Mesh axes along which the devices of a replica group differ (device id = row-major mesh index)."""
    if not groups:
        return []
    names, shape = list(mesh_shape), list(mesh_shape.values())
    varying = set()
    for g in groups:
        coords = np.array([np.unravel_index(i, shape) for i in g if i < math.prod(shape)])
        if len(coords) > 1:
            varying.update(i for i in range(len(shape)) if len(set(coords[:, i])) > 1)
    return [names[i] for i in sorted(varying)]


def collectives(hlo: str, mesh_shape: dict[str, int] | None = None) -> list[dict]:
    """Every collective op in optimized HLO text: kind, bytes (whole tensor), runs per step, axes."""
    comps, entry = _split_computations(hlo)
    mult = _multipliers(comps, entry)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            result, kind, _, rest = m.groups()
            operands = rest.split(")")[0]
            nbytes = max(_bytes(result), _bytes(operands))
            if "-start" in line and kind in ("all-gather", "collective-permute", "all-reduce"):
                nbytes = max(_bytes(result) // 2 if result.startswith("(") and kind != "all-reduce" else _bytes(result),
                             _bytes(operands))
            groups = _groups(line)
            out.append({"kind": kind, "bytes": nbytes, "times": max(mult.get(comp, 1), 1), "computation": comp,
                        "axes": _axes_of_groups(groups, mesh_shape) if mesh_shape else [],
                        "group_size": len(groups[0]) if groups else None})
    return out


def summarize(ops: list[dict]) -> dict[str, dict]:
    """kind -> {count, bytes} per step (loop trip counts applied)."""
    s: dict[str, dict] = {}
    for op in ops:
        d = s.setdefault(op["kind"], {"count": 0, "bytes": 0, "axes": set()})
        d["count"] += op["times"]
        d["bytes"] += op["bytes"] * op["times"]
        d["axes"].update(op["axes"])
    return {k: {**v, "axes": sorted(v["axes"])} for k, v in s.items()}


def memory(compiled) -> dict:
    """Per-device memory of a compiled SPMD program (XLA's `memory_analysis()`)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
            "generated_code_size_in_bytes")
    out = {k.replace("_size_in_bytes", ""): int(getattr(ma, k, 0) or 0) for k in keys}
    out["peak_estimate"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def flops(compiled) -> float | None:
    """XLA's `cost_analysis()` FLOPs per device (while bodies are counted once by XLA)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    return float(ca["flops"]) if ca and "flops" in ca else None


def render_sharding_table(rows: list[dict]):
    from rich.table import Table
    t = Table(title="parameter shardings", show_lines=False)
    for col in ("parameter", "shape", "logical axes", "PartitionSpec", "bytes/device"):
        t.add_column(col, justify="right" if col == "bytes/device" else "left")
    for r in rows:
        t.add_row(r["name"], "x".join(map(str, r["shape"])), ", ".join(str(n) for n in r["logical"]), r["spec"],
                  f"{r['bytes_per_device']:,}")
    total = sum(r["bytes_per_device"] for r in rows)
    t.add_row("total", "", "", "", f"{total:,}", style="bold")
    return t


def report(cfg) -> dict:
    """Compile one train step of `cfg` (no run) and describe it: the `meshpar inspect` JSON."""
    from meshpar.sharding import sharding_table
    from meshpar.train import Trainer, flops_per_token

    trainer = Trainer(cfg)
    compiled = trainer.compile()
    shape = trainer.describe()["mesh"]
    ops = collectives(compiled.as_text(), shape)
    tokens = cfg.batch.global_size * cfg.batch.length
    out = {
        "mesh": shape, "strategy": cfg.strategy, "precision": cfg.precision,
        "params": sharding_table(trainer.spec, trainer.layout),
        "collectives": {"summary": summarize(ops), "ops": ops},
        "memory": memory(compiled),
        "flops": {"xla_per_device": flops(compiled),
                  "model_per_step": flops_per_token(trainer.spec.cfg, trainer.spec.num_params, cfg.batch.length) * tokens},
    }
    return out


def render_report(rep: dict, console) -> None:
    from rich.table import Table
    console.print(f"[bold]mesh[/] {rep['mesh']}  [bold]strategy[/] {rep['strategy']}  [bold]precision[/] {rep['precision']}")
    console.print(render_sharding_table(rep["params"]))
    t = Table(title="collectives per step (compiled HLO)")
    for col in ("kind", "count", "bytes", "mesh axes"):
        t.add_column(col)
    for kind, s in sorted(rep["collectives"]["summary"].items()):
        t.add_row(kind, str(s["count"]), f"{s['bytes']:,}", ", ".join(s["axes"]))
    console.print(t)
    m = Table(title="memory per device (memory_analysis)")
    m.add_column("what")
    m.add_column("bytes", justify="right")
    for k, v in rep["memory"].items():
        m.add_row(k, f"{v:,}")
    console.print(m)
    f = rep["flops"]
    console.print(f"FLOPs: XLA cost_analysis {f['xla_per_device'] or 0:.4g} per device; "
                  f"model (6N + 12LHQT) {f['model_per_step']:.4g} per step")
