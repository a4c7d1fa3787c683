"""What a target's compiled program holds beside its collectives: the kernels its compiler chose, and
how much of each collective's transfer the scheduled compute hides.

Read from the optimized, scheduled HLO text (`compiled.as_text()`); instruction order inside a
computation is the schedule. Kernels, by name:

    cudnn:<target>      a cuDNN custom call (`__cudnn$fmhaSoftmax`: fused attention)
    cublas:<target>     a cuBLAS GEMM custom call
    triton:<kind>       a fusion XLA:GPU emits through Triton (`__triton_nested_gemm_fusion`: a GEMM)
    mosaic:<kernel>     a Pallas/Mosaic TPU kernel (`tpu_custom_call`), by its kernel name
    ragged-all-to-all   XLA's ragged exchange (dropless expert parallelism; async start/done counted once)
    custom:<target>     any other custom call

Overlap (per step, while bodies times their trip counts): an async collective `X-start` ... `X-done`
is hidden by the compute scheduled between its start and its done (fusions, dots, convolutions, custom
calls); one with none between, or a synchronous collective, is exposed: its bytes wait on the wire.
"""

from __future__ import annotations

import re
from collections import Counter

import jax

from meshpar.core.batch import is_leaf
from meshpar.plan import buffers, inspect
from meshpar.runtime import xla_flags
from meshpar.serve.engine import Engine
from meshpar.serve.placement import ABSTRACT
from meshpar.train.step import trainer_for

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r'"kind":"(__triton[\w]*)"')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_COMPUTE = (" fusion(", " convolution(", " custom-call(", " dot(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_SLICE_COPY = re.compile(r"ROOT %copy\S* = (\S+) copy\(%dynamic.slice")
_SLICE_ROOT = re.compile(r"ROOT %\S+ = (\w+\[1((?:,\d+)*)\])(\S*) dynamic-slice\(%([\w.\-]+),")
_ASYNC = re.compile(r"\s(" + "|".join(inspect.COLLECTIVES) + r")-start\(")
_DONE = re.compile(r"\s(" + "|".join(inspect.COLLECTIVES) + r")-done\(\s*%?([\w.\-]+)")
_SYNC = re.compile(r"\s(" + "|".join(inspect.COLLECTIVES) + r")\(")


def _base(name: str) -> str:
    return re.sub(r"\.\d+$", "", name)


def _fused(comps: dict[str, list[str]], call: str) -> set[str]:
    """Names of the computations that instructions matching `call` (a regex: " fusion\\(") call."""
    return {c for lines in comps.values() for line in lines if re.search(call, line) for c in _CALLS.findall(line)}


def sliced_copies(hlo: str, skip=frozenset()) -> list[str]:
    """Shapes of the loop slices the program copies out before using them: in XLA:GPU's decode step,
    each scanned layer's weights, every step. jaxlib 0.10 fuses each as copy(dynamic-slice(...));
    jaxlib 0.11 as a fusion (often asynchronous, `fusion-start`) whose root slices one layer [1, ...]
    out of a stacked parameter [L, ...] of the fused computation (not into another memory space:
    libtpu's slice into on-chip memory is a prefetch). Shapes whose dims ("1,64,128") are in `skip` are
    left out (a KV cache slice, counted by `cache_copies`)."""
    found = _SLICE_COPY.findall(hlo)
    comps, _ = inspect.split_computations(hlo)
    fused = _fused(comps, r" fusion(?:-start)?\(")
    for name, lines in comps.items():
        root = next(filter(None, map(_SLICE_ROOT.search, lines)), None) if name in fused else None
        if root is None or "S(" in root.group(3):  # into another memory space (libtpu's VMEM): a prefetch
            continue
        param = next((ln for ln in lines if re.match(rf"\s*%{re.escape(root.group(4))} = ", ln)), "")
        stacked = re.search(r"= \w+\[(\d+)((?:,\d+)*)\]", param)
        if stacked and int(stacked.group(1)) > 1 and stacked.group(2) == root.group(2):
            found.append(root.group(1))
    return [c for c in found if re.search(r"\[([\d,]*)\]", c).group(1) not in skip]


def cache_copies(hlo: str, slices) -> int:
    """Buffers the program materialises in the shape of one layer's KV cache slice (per device, `slices`
    a set of dims tuples): a fusion or copy, outside any fused computation, whose result is that slice;
    the slice copied out of the stacked cache, where a `meshpar.nn.kvcache` view reads it in place."""
    shapes = {",".join(map(str, d)) for d in slices} | {",".join(map(str, (1, *d))) for d in slices}
    comps, _ = inspect.split_computations(hlo)
    fused = _fused(comps, r" fusion\(")
    found = 0
    for name, lines in comps.items():
        if name in fused:
            continue
        for line in lines:
            head = line.split("=", 1)
            if len(head) < 2 or not re.search(r"\s(fusion|copy)\(", head[1]):
                continue
            result = re.split(r" (?:fusion|copy)\(", head[1])[0]
            found += sum(1 for dims in re.findall(r"\[([\d,]*)\]", result) if dims in shapes)
    return found


def kernels(hlo: str) -> dict[str, int]:
    """Kernel name -> instructions in the program (see the module docstring for the names)."""
    found: Counter = Counter()
    for line in hlo.splitlines():
        target = _TARGET.search(line)
        if target:
            t = target.group(1)
            name = _NAME.match(line)
            if t == "tpu_custom_call":
                found[f"mosaic:{_base(name.group(1)) if name else 'kernel'}"] += 1
            elif t.startswith("__cudnn"):
                found[f"cudnn:{t.removeprefix('__cudnn$')}"] += 1
            elif t.startswith("__cublas"):
                found[f"cublas:{t.removeprefix('__cublas$')}"] += 1
            else:
                found[f"custom:{t}"] += 1
            continue
        if " fusion(" in line:
            kind = _KIND.search(line)
            if kind:
                found[f"triton:{kind.group(1).removeprefix('__')}"] += 1
        if " ragged-all-to-all(" in line or " ragged-all-to-all-start(" in line:
            found["ragged-all-to-all"] += 1
    return dict(sorted(found.items()))


def overlap(hlo: str) -> dict:
    """Collective bytes per step hidden behind compute and exposed, by kind, from the schedule (libtpu's
    fused async collectives, `inspect.async_fusions`, at their start/done pair, matched by channel id)."""
    comps, entry = inspect.split_computations(hlo)
    mult = inspect.multipliers(comps, entry)
    out: dict[str, dict] = {}

    def add(kind, nbytes, times, hidden):
        d = out.setdefault(kind, {"ops": 0, "hidden_ops": 0, "hidden_bytes": 0, "exposed_bytes": 0})
        d["hidden_bytes" if hidden else "exposed_bytes"] += int(nbytes * times)
        d["ops"] += 1
        d["hidden_ops"] += int(hidden)

    fused_starts, repeats = inspect.async_fusions(comps)
    for comp, lines in comps.items():
        if comp in fused_starts or comp in repeats:  # libtpu's fused form: counted at its start/done pair
            continue
        times = max(mult.get(comp, 1), 1)
        starts: dict[str, tuple[str, int, int]] = {}
        for i, line in enumerate(lines):
            name = _NAME.match(line)
            a = _ASYNC.search(line)
            if a and name:
                m = inspect.INSTR.match(line)
                shapes = inspect.start_shapes(m.group(1), a.group(1), True) if m else []
                starts[name.group(1)] = (a.group(1), i, sum(shapes))
                continue
            fused = inspect.fused_collective(line, comps)  # libtpu's async collective fusion, paired by channel
            if fused and fused[0] == "start":
                starts[f"channel {fused[1]}"] = (fused[2], i, fused[3])
                continue
            d = _DONE.search(line)
            key = f"channel {fused[1]}" if fused else d.group(2) if d else None
            if key in starts:
                kind, begin, nbytes = starts.pop(key)
                between = [ln for ln in lines[begin + 1 : i] if not inspect.FUSED.match(ln)]  # another's start/done
                add(kind, nbytes, times, any(op in ln for ln in between for op in _COMPUTE))
                continue
            s = _SYNC.search(line)
            if s and not _TARGET.search(line):
                m = inspect.INSTR.match(line)
                add(s.group(1), sum(inspect.start_shapes(m.group(1), s.group(1), False)) if m else 0, times, False)
        for key, (kind, _, nbytes) in starts.items():  # a fused start whose done this computation lacks
            if key.startswith("channel "):
                add(kind, nbytes, times, False)
    total = {k: sum(d[k] for d in out.values()) for k in ("hidden_bytes", "exposed_bytes")}
    return {"by_kind": out, **total}


def compile_with_live_ranges(target, trainer) -> tuple[object, list[str], str | None, str | None]:
    """`meshpar.plan.target.compile_trainer` with the compiler's own dump written to a scratch folder:
    (compiled, notes, the text of its buffer live ranges, and of its buffer assignment; None where the
    compiler wrote none), for `meshpar.plan.buffers.peak_buffers`."""
    import glob
    import os
    import tempfile

    from meshpar.plan.target import compile_trainer  # local: the target compilers load only for a --target

    def last(tmp, kind):
        found = sorted(glob.glob(os.path.join(tmp, f"*after_optimizations-{kind}.txt")))
        return open(found[-1]).read() if found else None

    with tempfile.TemporaryDirectory(prefix="meshpar-dump-") as tmp:
        compiled, notes = compile_trainer(
            target, trainer, {"xla_dump_to": tmp, "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": ".*step.*"}
        )
        return compiled, notes, last(tmp, "live-range"), last(tmp, "buffer-assignment")


def report(cfg, target) -> dict:
    """`meshpar inspect --target`: the step of `cfg` compiled for `target`'s devices by its own compiler,
    described as `meshpar.plan.inspect.report` does, plus `target` (`target_report`, with the buffers
    live at the compiler's peak)."""
    import time

    trainer = trainer_for(cfg, devices=target.devices)
    start = time.perf_counter()
    compiled, notes, live, assignment = compile_with_live_ranges(target, trainer)
    seconds = time.perf_counter() - start
    rep = inspect.report(cfg, trainer)  # the same compiled step (Trainer.compile compiles once)
    rep["warnings"] += notes
    hlo = compiled.as_text()
    rep["target"] = target_report(target, compiled, hlo, rep["memory"], seconds)
    rep["target"]["peak_buffers"], rep["target"]["peak_buffers_held"] = buffers.at_peak(live, hlo, assignment)
    return rep


# how `DoesNotFit` words a decode step too large for the chip
SERVE_WORDS = {
    "what": "the decode step",
    "held": "weights and KV cache",
    "advice": "serve fewer slots or a shorter cache (serve.slots, serve.cache_length), or split the weights and "
    "cache over more chips (mesh.tensor)",
}


def serve_report(cfg, target=None) -> dict:
    """`meshpar inspect --serve [--target HW]`: the serving decode step (one token for every slot, its
    KV cache in place) compiled without weights (`meshpar.serve.placement.ABSTRACT`): its memory and
    collectives, and on a target its `target` view."""
    import time

    engine = Engine(
        cfg,
        devices=target.devices if target else None,
        weights=ABSTRACT,
        info=lambda _: None,
        device_memory=int(target.hardware.memory_bytes) if target else None,
    )
    start = time.perf_counter()
    from meshpar.plan.target import launch_options, too_large  # local: beside compile_with_live_ranges' import

    try:
        compiled = engine.compiled_generate(launch_options(target) if target else None)
    except Exception as e:  # noqa: BLE001 - libtpu's refusal of a decode step too large for the chip is a verdict
        refused = (
            too_large(target, e, lambda: sum(engine.bytes_per_device().values()), **SERVE_WORDS) if target else None
        )
        if refused:
            raise refused from None
        raise
    seconds = time.perf_counter() - start
    shape = dict(zip(engine.mesh.axis_names, engine.mesh.devices.shape))
    hlo = compiled.as_text()
    stacked = [
        sharding.shard_shape(leaf.shape)[1:]
        for leaf, sharding in zip(
            jax.tree.leaves(engine.placement.cache_spec, is_leaf=is_leaf),
            jax.tree.leaves(engine.state_shardings["cache"]),
        )
        if leaf.axes and leaf.axes[0] == "layers"
    ]
    copies = sliced_copies(hlo, skip={",".join(map(str, (1, *d))) for d in stacked})  # cache: counted below
    slow = (
        [
            f"the decode step copies each layer's weights out of the stacked arrays every step ({len(copies)} "
            "tensors per layer, the scanned layer loop): serve.decode_loop=unrolled reads them in place "
            "(Llama-3 8B on one H200: 13.9 -> 7.5 ms per step at one slot)"
        ]
        if copies and engine.programs.loop == "scan" and cfg.model.scan_layers
        else []
    )
    copied = cache_copies(hlo, set(stacked)) if stacked else 0
    if copied:
        views = getattr(getattr(engine.placement.abstract, "layers", None), "cache_views", False)
        slow.append(
            f"the decode step copies each layer's KV cache slice {list(stacked[0])} out of the stacked cache "
            f"every step ({copied} buffers per layer); "
            + (
                "XLA's fusions chose to, at this shape (bench/RESULTS.md: the decode step's cache traffic)"
                if views
                else "a stacked layer class that writes through meshpar.nn.kvcache and sets cache_views = True "
                "reads and updates it in place"
            )
        )
    out = {
        "mesh": shape,
        "strategy": cfg.serve.strategy,
        "precision": cfg.precision,
        "warnings": list(engine.notes) + slow,
        "decode": {
            "slots": engine.slots,
            "cache_length": engine.length,
            "cache_slice_copies": copied,
            **engine.bytes_per_device(),
        },
        "collectives": {"summary": inspect.summarize(inspect.collectives(hlo, shape))},
        "memory": inspect.memory(compiled),
    }
    if target is not None:
        out["target"] = target_report(target, compiled, hlo, out["memory"], seconds)
    return out


def target_report(target, compiled, hlo: str, mem: dict, seconds: float) -> dict:
    """The target's own view of its compiled program: the devices, whether the peak fits their memory
    and by how much, the kernels chosen, the collective bytes the schedule hides or exposes
    (`meshpar.plan.program`), XLA's cost analysis (None where the compiler gives none) and the
    compile time."""
    peak, hbm = mem.get("peak_estimate", 0), int(target.hardware.memory_bytes)
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else None) if isinstance(ca, (list, tuple)) else ca
    return {
        **target.describe(),
        "compile_s": round(seconds, 2),
        "peak_bytes": peak,
        "fits": peak <= hbm,
        "headroom_bytes": hbm - peak,
        "kernels": kernels(hlo),
        "overlap": overlap(hlo),
        "cost": {"flops": ca.get("flops"), "bytes_accessed": ca.get("bytes accessed")} if ca else None,
    }


def describe_op(op_name: str) -> str:
    """A JAX op name in a few words: its pass (forward under `jvp`, backward under its `transpose`,
    else "step": the update, or a framework that differentiates otherwise), whether in a loop, and its
    last two names ("backward loop: bte,ecf->btcf/dot_general")."""
    if not op_name:
        return ""
    phase = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "step"
    return f"{phase}{' loop' if '/while/' in op_name else ''}: {'/'.join(op_name.split('/')[-2:])}"


def render_target(t: dict, console) -> None:
    gib = 2**30
    verdict = (
        f"fits, {t['headroom_bytes'] / gib:.2f} GiB to spare"
        if t["fits"]
        else f"does NOT fit: {-t['headroom_bytes'] / gib:.2f} GiB over"
    )
    console.print(
        f"[bold]target[/] {t['devices']} x {t['device_kind']} ({t['name']}, {t['topology']}), compiled by its "
        f"own compiler ({t.get('compiler', '?')}) in {t['compile_s']} s: peak {t['peak_bytes'] / gib:.3f} GiB of "
        f"{t['memory_bytes'] / gib:.1f} GiB per device, {verdict}",
        highlight=False,
    )
    if t.get("xla_flags"):  # the flags a launched job runs with (meshpar.runtime.xla_flags), the user's too
        flags = " ".join(xla_flags.arg(k, v) for k, v in t["xla_flags"].items())
        console.print(f"XLA flags: {flags}", markup=False, highlight=False)
    console.print(
        "kernels: " + (", ".join(f"{k} x{n}" for k, n in t["kernels"].items()) or "none beyond XLA's own"),
        markup=False,
        highlight=False,
    )
    ov = t["overlap"]
    console.print(
        f"collectives behind compute: {ov['hidden_bytes']:,} bytes hidden, {ov['exposed_bytes']:,} exposed "
        "per step (scheduled HLO)",
        highlight=False,
    )
    if t.get("peak_buffers"):
        named = {b["name"]: describe_op(b["op_name"]) or b["name"] for b in t["peak_buffers"]}
        console.print(
            "live at the compiler's peak (temporaries, largest first): "
            + "; ".join(
                f"{b['bytes'] / 2**20:,.{0 if b['bytes'] >= 10 * 2**20 else 2}f} MiB {b['shape']} {b['opcode']} "
                f"({describe_op(b['op_name']) or b['name']})"
                + (f" in the slot of {named.get(b['slot_of'], b['slot_of'])}" if b.get("slot_of") else "")
                for b in t["peak_buffers"][:5]
            ),
            markup=False,
            highlight=False,
        )
    if t["cost"]:
        console.print(
            f"cost analysis: {t['cost']['flops'] or 0:.4g} FLOPs, {t['cost']['bytes_accessed'] or 0:.4g} "
            "bytes accessed per device",
            highlight=False,
        )


def render_serve(rep: dict, console) -> None:
    d, gib = rep["decode"], 2**30
    console.print(
        f"[bold]decode step[/] mesh {rep['mesh']}  serve.strategy {rep['strategy']}  precision {rep['precision']}: "
        f"{d['slots']} slots x {d['cache_length']} positions; per device weights {d['weights'] / gib:.3f} GiB, "
        f"KV cache {d['cache'] / gib:.3f} GiB",
        highlight=False,
    )
    for line in rep.get("warnings", []):
        console.print(line, markup=False)
    kinds = rep["collectives"]["summary"]
    console.print(
        "collectives per token: "
        + (
            ", ".join(
                f"{k} x{v['count']:g} {v['bytes']:,} B over {'/'.join(v['axes'])}" for k, v in sorted(kinds.items())
            )
            or "none"
        ),
        highlight=False,
    )
    m = rep["memory"]
    console.print(
        f"memory per device: peak {m.get('peak_estimate', 0) / gib:.3f} GiB (arguments {m.get('argument', 0):,}, "
        f"temp {m.get('temp', 0):,} bytes)",
        highlight=False,
    )
