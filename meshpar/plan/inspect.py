"""Look inside a compiled step: collectives in the HLO, memory per device, FLOPs, the sharding table.

Collectives are read from the optimized HLO text. Each op's `bytes` is the size of the *whole*
tensor it moves (the gathered result of an all-gather, the result x group size of a
reduce-scatter, the operand of an all-reduce), so an all-reduce and the all-gather + reduce-scatter pair
that replaces it under sequence parallelism compare directly. Ops inside a `while` body (scanned
layers, gradient accumulation) are multiplied by the loop's known trip count: numbers are per step.
Replica groups are mapped back to the mesh axes they span.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import jax
import numpy as np

from meshpar.core.hlo import device_groups
from meshpar.core.sharding import render_sharding_table
from meshpar.parallel.schedules import BRANCH_SHARE
from meshpar.parallel.schedules import describe as describe_pipeline
from meshpar.train.step import trainer_for

_SHARE = re.compile(re.escape(BRANCH_SHARE) + r"([\d.e+-]+)")  # a per-device branch's share of its loop
# ragged-all-to-all first: the alternation must not read its tail as an all-to-all
COLLECTIVES = ("ragged-all-to-all", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\((.*)$")


def split_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Computation name -> its instruction lines. Headers are the unindented lines ending in '{'."""
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = _COMP.match(line)
            if m:
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


def multipliers(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of ENTRY (while bodies x trip count)."""
    calls = defaultdict(list)  # caller -> [(callee, times)]
    for name, lines in comps.items():
        for line in lines:
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            body = re.search(r"body=%?([\w.\-]+)", line)
            if body:
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                n = int(trip.group(1)) if trip else _trip_from_condition(comps.get(cond.group(1), []) if cond else [])
                calls[name].append((body.group(1), n))
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


def _trip_from_condition(lines: list[str]) -> int:
    """A scan's trip count from its loop condition `i < N` (libtpu's text carries no known_trip_count):
    N when the ROOT compares against one integer constant with LT, else 1."""
    consts = dict(re.findall(r"%?([\w.\-]+) = s32\[\]\S* constant\((\d+)\)", "\n".join(lines)))
    root = next((ln for ln in lines if ln.lstrip().startswith("ROOT") and "direction=LT" in ln), "")
    args = re.search(r"compare\(%?[\w.\-]+, %?([\w.\-]+)\)", root)
    return int(consts[args.group(1)]) if args and args.group(1) in consts else 1


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


def _result_shapes(result: str) -> list[int]:
    return [_DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _SHAPE.findall(result)]


def start_shapes(result: str, kind: str, start: bool) -> list[int]:
    """Bytes of each tensor a collective moves, from its result type. An async start's result is
    (operands..., outputs...): the outputs. A ragged all-to-all's is its output buffer, the most it
    can receive (what it sends depends on the data: an upper bound)."""
    shapes = _result_shapes(result)
    if kind == "ragged-all-to-all":
        return shapes[-1:]
    if start and result.startswith("(") and kind != "all-reduce":
        return shapes[len(shapes) // 2 :]
    return shapes


def _users(lines: list[str], name: str) -> list[str]:
    pat = re.compile(r"[(, ]%" + re.escape(name) + r"[,) ]")
    return [ln for ln in lines if pat.search(ln) and not ln.lstrip().startswith("%" + name + " ")]


_PASS_THROUGH = ("bitcast(", "copy(", "reshape(", "transpose(", "convert(")


def _is_pass_through_fusion(u: str, comps: dict[str, list[str]]) -> bool:
    """A fusion that only converts/reshapes its single operand (e.g. XLA's `wrapped_convert`)."""
    fused = re.search(r"calls=%?([\w.\-]+)", u)
    if " fusion(" not in u or not fused or fused.group(1) not in comps:
        return False
    body = [ln for ln in comps[fused.group(1)] if "parameter(" not in ln]
    return bool(body) and all(any(p in ln for p in _PASS_THROUGH) for ln in body)


def _is_scattered(lines: list[str], name: str, comps: dict[str, list[str]], depth: int = 0) -> bool:
    """True if every use of value `name` keeps only a per-device slice of it: a dynamic-slice, a
    fusion whose fused computation dynamic-slices that operand, or a conversion whose result is
    itself only sliced. This is the all-reduce + dynamic-slice pattern that GPU/TPU compilers turn
    into a reduce-scatter (the CPU backend keeps it as it is)."""
    users = _users(lines, name)
    if not users or depth > 6:
        return False
    for u in users:
        if "dynamic-slice(" in u:
            continue
        out = u.split("=")[0].strip().removeprefix("ROOT").strip().lstrip("%")
        if (any(p in u for p in _PASS_THROUGH) or _is_pass_through_fusion(u, comps)) and _is_scattered(
            lines, out, comps, depth + 1
        ):
            continue
        fused = re.search(r"calls=%?([\w.\-]+)", u)
        args = re.search(r"\bfusion\((.*?)\), kind=", u)
        if fused and args and fused.group(1) in comps:
            operands = [a.strip().lstrip("%") for a in args.group(1).split(",")]
            body = comps[fused.group(1)]
            idx = [i for i, a in enumerate(operands) if a == name]
            params = [re.match(r"\s*%?([\w.\-]+) = .*parameter\((\d+)\)", ln) for ln in body]
            pnames = {int(p.group(2)): p.group(1) for p in params if p}
            if idx and all(i in pnames and _is_scattered(body, pnames[i], comps, depth + 1) for i in idx):
                continue
        return False
    return True


FUSED = re.compile(r"^\s*(?:ROOT\s+)?%?async-collective-(start|done)[\w.\-]* = .*\bcalls=%?([\w.\-]+)")


def async_fusions(comps: dict[str, list[str]]) -> tuple[set[str], set[str]]:
    """libtpu's async collective fusion (`--xla_tpu_enable_async_collective_fusion`): each collective is
    written three times, under one channel id, in the computation its `async-collective-start` fusion
    calls, in compute fusions over `async_collective_fusion.*` that carry pieces of it, and in the one
    its `async-collective-done` fusion calls. -> (the start computations, which count it; the others,
    which repeat it)."""
    starts: set[str] = set()
    repeats = {c for c in comps if c.startswith("async_collective_fusion")}
    for lines in comps.values():
        for line in lines:
            fused = FUSED.match(line)
            if fused:
                (starts if fused.group(1) == "start" else repeats).add(fused.group(2))
            elif "async_collective_fusion" in line:
                repeats.update(
                    c for c in re.findall(r"calls=%?([\w.\-]+)", line) if c.startswith("async_collective_fusion")
                )
    return starts, repeats - starts


def fused_collective(line: str, comps: dict[str, list[str]]) -> tuple[str, str, str, int] | None:
    """An `async-collective-start`/`-done` line (`async_fusions`) -> ("start" or "done", the channel id
    that pairs them, the collective's kind, its bytes); None for any other line."""
    fused = FUSED.match(line)
    if not fused:
        return None
    body = comps.get(fused.group(2), [])
    ops = [m.groups() for m in map(INSTR.match, body) if m]
    channel = re.search(r"channel_id=(\d+)", "\n".join(body))
    nbytes = sum(sum(start_shapes(r, k, False)) for r, k, _, _ in ops)
    return fused.group(1), channel.group(1) if channel else fused.group(2), ops[0][1] if ops else "all-gather", nbytes


def collectives(hlo: str, mesh_shape: dict[str, int] | None = None) -> list[dict]:
    """Every collective op in optimized HLO text: kind, bytes (whole tensor), runs per step, axes.

    An all-reduce whose results are only ever sliced per device is reported as kind
    `reduce-scatter` with `lowered_as: "all-reduce+dynamic-slice"` (what it is on GPU/TPU, what it
    means for memory, and honest about what runs on CPU); tuple all-reduces are split per element.
    A collective inside a per-device branch named with `meshpar.parallel.schedules.BRANCH_SHARE` (1F1B's
    switch) runs that share of its loop's iterations, averaged over the devices; any other branch
    counts on every run of its conditional (an upper bound).
    """
    comps, entry = split_computations(hlo)
    mult = multipliers(comps, entry)
    repeats = async_fusions(comps)[1]
    out = []
    for comp, lines in comps.items():
        if comp in repeats:  # libtpu's fused form repeats a collective its start computation counts
            continue
        for line in lines:
            m = INSTR.match(line)
            if not m:
                continue
            result, kind, start, _ = m.groups()
            shapes = start_shapes(result, kind, bool(start))
            groups = device_groups(line)
            group_size = len(groups[0]) if groups and kind != "collective-permute" else 1
            share = _SHARE.search(line)
            times = max(mult.get(comp, 1), 1) * (float(share.group(1)) if share else 1)
            base = {
                "times": times,
                "computation": comp,
                "axes": _axes_of_groups(groups, mesh_shape) if mesh_shape else [],
                "group_size": group_size if groups else None,
            }
            if kind == "all-reduce" and not start and group_size > 1:
                name = line.split("=")[0].strip().removeprefix("ROOT").strip().lstrip("%")
                if result.startswith("("):
                    parts = {}
                    for u in _users(lines, name):
                        gte = re.match(r"\s*%?([\w.\-]+) = .*get-tuple-element\(.*index=(\d+)", u)
                        if gte:
                            parts[int(gte.group(2))] = _is_scattered(lines, gte.group(1), comps)
                    scattered = [parts.get(i, False) for i in range(len(shapes))]
                else:
                    scattered = [_is_scattered(lines, name, comps)]
                rs = sum(s for s, sc in zip(shapes, scattered) if sc)
                if rs:
                    out.append(
                        {"kind": "reduce-scatter", "bytes": rs, "lowered_as": "all-reduce+dynamic-slice", **base}
                    )
                if sum(shapes) - rs:
                    out.append({"kind": "all-reduce", "bytes": sum(shapes) - rs, **base})
                continue
            nbytes = sum(shapes) * (group_size if kind == "reduce-scatter" else 1)
            out.append({"kind": kind, "bytes": nbytes, **base})
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
    """Per-device memory of a compiled SPMD program (XLA's `memory_analysis()`), and its peak,
    `peak_estimate`: argument + output + temp - alias, except on a device target (XLA:GPU, libtpu),
    where it is the compiler's own (`peak_memory_in_bytes`, also kept as `compiler_peak`). libtpu's
    comes from its heap simulation and differs from the sum either way (bench/RESULTS.md, "libtpu's own
    peak"); XLA:GPU's is within a few percent below it. XLA:CPU's own is recorded but not used: the
    planner's "cpu" rules were fitted to the sum."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    keys = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    out = {k.replace("_size_in_bytes", ""): int(getattr(ma, k, 0) or 0) for k in keys}
    out["peak_estimate"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    compiler_peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    if compiler_peak:
        out["compiler_peak"] = compiler_peak
        if _platform(compiled) != "cpu":
            out["peak_estimate"] = compiler_peak
    return out


def _platform(compiled) -> str:
    """The platform a compiled program's devices are of ("cpu", "gpu", "tpu")."""
    for sharding in jax.tree.leaves(compiled.input_shardings):
        return next(iter(sharding.device_set)).platform
    return "cpu"


def flops(compiled) -> float | None:
    """XLA's `cost_analysis()` FLOPs per device (while bodies are counted once by XLA)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    return float(ca["flops"]) if ca and "flops" in ca else None


def report(cfg, trainer=None) -> dict:
    """Compile one train step of `cfg` (no run) and describe it: the `meshpar inspect` JSON (for a
    deviceless target: `meshpar.plan.program.report`)."""

    trainer = trainer or trainer_for(cfg)
    compiled = trainer.compile()
    shape = trainer.describe()["mesh"]
    ops = collectives(compiled.as_text(), shape)
    model_flops, counted = trainer.model_flops()
    out = {
        "mesh": shape,
        "strategy": cfg.strategy,
        "precision": cfg.precision,
        "warnings": trainer.warnings(),
        "params": trainer.sharding_table(),
        "collectives": {"summary": summarize(ops), "ops": ops},
        "memory": memory(compiled),
        "flops": {"xla_per_device": flops(compiled), "model_per_step": model_flops, "model_counted_as": counted},
    }
    if shape.get("pipeline", 1) > 1:  # schedule tick table, its bubble, peak temporary memory per device
        out["pipeline"] = {
            **describe_pipeline(cfg.pipeline, shape["pipeline"]),
            "peak_temp_bytes": out["memory"].get("temp"),
        }
    return out


def render_report(rep: dict, console) -> None:
    from rich.table import Table

    console.print(
        f"[bold]mesh[/] {rep['mesh']}  [bold]strategy[/] {rep['strategy']}  [bold]precision[/] {rep['precision']}"
    )

    for line in rep.get("warnings", []):
        console.print(line, markup=False)
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
    console.print(
        f"FLOPs: XLA cost_analysis {f['xla_per_device'] or 0:.4g} per device; "
        f"model {f['model_per_step']:.4g} per step ({f['model_counted_as']})"
    )
    if "pipeline" in rep:
        pp = rep["pipeline"]
        v = f", v={pp['virtual_stages']}" if pp["virtual_stages"] > 1 else ""
        console.print(
            f"[bold]pipeline[/] {pp['schedule']} P={pp['stages']} M={pp['microbatches']}{v}: "
            f"{pp['ticks']} ticks, bubble {pp['bubble']:.3f}, stash per stage {pp['in_flight']}, "
            f"peak temporary memory {pp['peak_temp_bytes'] or 0:,} bytes/device"
        )
        for line in pp["lines"]:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
