"""`meshpar plan`: choose the mesh, strategy, microbatches and remat for a cluster, and prove it.

    result = plan(cfg, devices=64, hardware=load_hardware("h100"))   # JSON-able dict, best first
    verify(result, cfg, k=2)                                           # compile the top 2 on fake devices

Search: every way to write N = pipeline x data x fsdp x context x expert x tensor (sizes that divide the model;
`context` dividing batch.length / 2), split into ICI x DCN by filling the hardware's ICI domain from the
innermost axis (`tensor` first, as `meshpar.core.mesh` orders them), times every preset that uses those axes,
remat (`none | save_dots | full`), gradient-accumulation microbatches (powers of two) or, with a pipeline axis,
every pipeline microbatch count M >= P that divides a replica's rows (down to one sequence each) and schedules
(gpipe, 1f1b, interleaved with v = 2, 3 or 4 chunks where the layers and M allow). Each candidate is costed by
`meshpar.plan.costmodel` (its docstring holds every formula and its source); those that do not fit in device
memory are dropped (kept with --all) and the rest ranked: first those that fit with the planner's own margin of
error (its memory is within 15% of the compiled step's), then those predicted to fit within it, each by predicted
step time. Ties (collectives fully hidden behind compute) go to fewer bytes on the wire, then to the most memory
headroom, then the simpler preset
(dp < zero1 < zero2 < fsdp < hsdp < tp < tp_sp < fsdp_tp < fsdp_tp_sp). Nothing is special-cased: TP inside a
node, PP across nodes and DP outermost come out of the bandwidths and the memory, or do not.

Each mesh axis maps to one preset family so the same layout is not listed twice: dp/zero1/zero2 put the batch on
`data`; fsdp on `fsdp`; hsdp on fsdp (ICI) x data (DCN); tp/tp_sp on `tensor` x `data`; fsdp_tp and fsdp_tp_sp
on `tensor` x `fsdp`; any of them may add `pipeline`, `context` and (MoE models) `expert`.
"""

from __future__ import annotations

import heapq
import math

from meshpar.core.config import apply_overrides
from meshpar.core.errors import ConfigError, suggest
from meshpar.core.mesh import MESH_AXES, split_sizes
from meshpar.core.precision import get_policy
from meshpar.core.rules import PRESETS
from meshpar.plan.candidates import ORDER, Pins, candidates, overrides
from meshpar.plan.collectives import summarize
from meshpar.plan.costmodel import Candidate, ModelFacts, Resolver
from meshpar.plan.hardware import PRESETS as HW
from meshpar.plan.steptime import evaluate, lower_bound

GiB = 2**30


def parse_bytes_per_param(text: str | None, precision: str) -> tuple:
    """'2,2,12' -> (2, 2, 12); default: what the precision policy stores (param dtype for weights and
    gradients, two AdamW moments in the param dtype)."""
    if not text:
        import numpy as np

        w = np.dtype(get_policy(precision).param_dtype).itemsize
        return (w, w, 2 * w)
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != 3 or min(vals) < 0:
        raise ConfigError(f"--bytes-per-param '{text}' must be three numbers W,G,O (e.g. 2,2,12 for ZeRO's accounting)")
    return vals


def _mesh_str(cand: Candidate) -> str:
    s, dcn = cand.shape, cand.dcn_shape
    parts = [f"{a}={v}" + (f"({dcn[a]} dcn)" if dcn[a] > 1 else "") for a, v in s.items() if v > 1]
    return " ".join(parts) or "1 device"


def _why(row: dict, best: dict | None, hw) -> str:
    """Why a candidate lost to the winner, in a few words."""
    if not row["fits"]:
        return f"needs {row['memory']['total'] / GiB:.1f} GiB > {hw.memory_bytes / GiB:.0f} GiB"
    if best is None or row is best:
        return "winner"
    a, w = row["time"], best["time"]
    diffs = {
        "compute": a["compute_s"] - w["compute_s"],
        "exposed comm": a["exposed_comm_s"] - w["exposed_comm_s"],
        "bubble": a["bubble_s"] - w["bubble_s"],
        "comm not hidden": a["unhidden_s"] - w["unhidden_s"],
    }
    key = max(diffs, key=diffs.get)
    slower = a["step_s"] / w["step_s"] - 1
    if _tight(row, hw.memory_bytes) and not _tight(best, hw.memory_bytes):
        return f"under {MARGIN - 1:.0%} memory headroom: may not fit"
    if slower < 1e-3:
        if a["comm_s"] > w["comm_s"] * 1.001:
            return "tie: more bytes on the wire"
        return (
            "tie: less memory headroom"
            if row["memory"]["total"] > best["memory"]["total"]
            else "tie: simpler preset first"
        )
    return f"+{100 * slower:.0f}% step: {key} +{diffs[key]:.3g} s"


def _runs(rows: list, key, rel: float = 1e-3) -> list[list]:
    """`rows` (sorted by `key`) cut into runs whose values lie within `rel` of the run's first."""
    out, i = [], 0
    while i < len(rows):
        j = i
        while j < len(rows) and key(rows[j]) <= key(rows[i]) * (1 + rel):
            j += 1
        out.append(rows[i:j])
        i = j
    return out


MARGIN = 1.15  # the planner's memory is within 15% of the compiled step's (bench/RESULTS.md, ## Planner)


def _tight(row: dict, memory_bytes: float) -> bool:
    """Predicted to fit, but not by the planner's own margin of error."""
    return row["memory"]["total"] * MARGIN > memory_bytes


def _rank(rows: list, memory_bytes: float) -> list:
    """Those that fit with the planner's margin of error (`MARGIN`) first, then those predicted to fit
    within it (they may not), then the rest; each by step time. Candidates within 0.1% of each other's
    step time (all collectives hidden) are ordered by time on the wire, then by memory per device (the
    most headroom first), then the simpler preset."""
    out = []
    tiers = (
        [r for r in rows if r["fits"] and not _tight(r, memory_bytes)],  # fit with the planner's margin
        [r for r in rows if r["fits"] and _tight(r, memory_bytes)],  # predicted to fit, within its error
        [r for r in rows if not r["fits"]],
    )
    for tier in tiers:
        part = sorted(tier, key=lambda r: r["time"]["step_s"])
        for tie in _runs(part, lambda r: r["time"]["step_s"]):
            for same in _runs(sorted(tie, key=lambda r: r["time"]["comm_s"]), lambda r: r["time"]["comm_s"]):
                out += sorted(same, key=lambda r: (r["memory"]["total"], ORDER.index(r["cand"].strategy)))
    return out


def _layout(cand: Candidate) -> tuple:
    """What one row of the table stands for: mesh, preset and schedule (its best remat and microbatching)."""
    return cand.mesh, cand.strategy, cand.schedule if cand.shape["pipeline"] > 1 else ""


def _cost(cands: list, facts, hw, res, bpp, c, top: int | None) -> list:
    """Rows of the candidates that can rank in the top `top` layouts (all of them when `top` is None).
    Branch and bound: candidates are costed cheapest lower bound first (their matmuls and bubble,
    `steptime.lower_bound`), and the search stops at the first whose bound exceeds, beyond the
    ranking's tie margin, the step of the `top`-th best fitting layout found so far: none after it
    can rank. When nothing fits, every candidate is costed (the error names the smallest)."""
    if top is None:
        bounded = [(0.0, cand) for cand in cands]
    else:
        bounded = sorted(((lower_bound(facts, cand, hw, c), cand) for cand in cands), key=lambda x: x[0])
    rows, best, limit = [], {}, math.inf  # best: layout -> its fastest fitting step
    for bound, cand in bounded:
        if bound > limit * (1 + 2e-3):
            break
        ev = evaluate(facts, cand, hw, res, bpp, c)
        if ev is None:
            continue
        rows.append({"cand": cand, **ev})
        if ev["fits"]:
            k = _layout(cand)
            best[k] = min(best.get(k, math.inf), ev["time"]["step_s"])
            if top and len(best) >= top and len(rows) % 16 == 0:  # checked now and then: the bound only tightens
                limit = heapq.nsmallest(top, best.values())[-1]
    return rows


def plan(
    cfg,
    devices: int,
    hardware,
    strategies=None,
    bytes_per_param=None,
    keep_all: bool = False,
    top: int | None = None,
    pins: Pins | None = None,
) -> dict:
    """Cost every candidate that agrees with `pins` (the keys the user fixed) and rank them. Returns
    the `meshpar plan --json` object."""
    hardware.check_devices(devices)
    pins = pins or Pins()
    for st in strategies or ():
        if st not in PRESETS:
            raise ConfigError(f"unknown strategy '{st}' in --strategies" + suggest(st, PRESETS))
    if pins.strategy and strategies and pins.strategy not in strategies:
        raise ConfigError(
            f"strategy={pins.strategy} is not among --strategies {','.join(strategies)}; give one or the other"
        )
    strategies = [pins.strategy] if pins.strategy else list(strategies or ORDER)
    bpp = bytes_per_param or parse_bytes_per_param(None, cfg.precision)
    import numpy as np

    c = np.dtype(get_policy(cfg.precision).compute_dtype).itemsize
    facts = ModelFacts.from_config(cfg)
    res = Resolver(cfg.rules)
    cands = [cand for cand in candidates(facts, devices, hardware, strategies) if pins.allows(cand)]
    rows = _cost(cands, facts, hardware, res, bpp, c, None if keep_all else (top or 10))
    if not rows:
        which = [] if pins.strategy else [f"--strategies {','.join(strategies)}"]
        raise ConfigError(
            f"no mesh of {devices} devices can shard this model with {' and '.join(which + list(pins.keys))}"
            f" (sizes must divide layers, heads, batch.global_size="
            f"{cfg.batch.global_size}); try another --devices or batch.global_size"
            + (", or pin less" if pins.keys else "")
        )
    fitting = [r for r in rows if r["fits"]]
    if not fitting and not keep_all:
        small = min(rows, key=lambda r: r["memory"]["total"])
        raise ConfigError(
            f"the model ({facts.params / 1e9:.3g}B parameters) fits on no plan of {devices} "
            f"{hardware.name}: the smallest needs {small['memory']['total'] / GiB:.1f} GiB per device "
            f"({small['cand'].strategy}, {_mesh_str(small['cand'])}, remat {small['cand'].remat}) "
            f"and a device has {hardware.memory_bytes / GiB:.0f} GiB; add devices or shrink the batch"
        )

    ordered = _rank(rows if keep_all else fitting, hardware.memory_bytes)
    best = ordered[0] if ordered[0]["fits"] else None
    limit = None if keep_all else (top or 10)
    if not keep_all:  # one row per layout: its best remat / microbatching
        seen, kept = set(), []
        for r in ordered:
            k = _layout(r["cand"])
            if k not in seen:
                seen.add(k)
                kept.append(r)
        ordered = kept
    out = []
    for r in ordered[:limit]:
        cand = r["cand"]
        out.append(
            {
                "mesh": cand.shape,
                "dcn": {a: v for a, v in cand.dcn_shape.items() if v > 1},
                "strategy": cand.strategy,
                "microbatches": cand.microbatches,
                "pipeline": (
                    {"schedule": cand.schedule, "microbatches": cand.pp_microbatches, "virtual_stages": cand.virtual}
                    if cand.shape["pipeline"] > 1
                    else None
                ),
                "remat": cand.remat,
                "memory": {k: int(v) for k, v in r["memory"].items()},
                "time": r["time"],
                "collectives": {k: int(v) for k, v in summarize(r["collectives"]).items()},
                "fits": r["fits"],
                "why": _why(r, best, hardware),
                "overrides": overrides(cand, devices),
            }
        )
    return {
        "model": {"params": facts.params, "flops_per_token": facts.flops_per_token, "dims": facts.dims},
        "pinned": list(pins.keys),
        "hardware": hardware.as_dict(),
        "devices": devices,
        "bytes_per_param": list(bpp),
        "batch": {"global_size": cfg.batch.global_size, "length": cfg.batch.length},
        "searched": len(cands),
        "costed": len(rows),
        "fitting": len(fitting),
        "candidates": out,
    }


def winner_yaml(result: dict, config_path: str | None, user_overrides: list[str], best: dict | None = None) -> str:
    """A plan (default: the best that fits) as a YAML file `meshpar train --config` accepts: the
    user's config (as `base`), their KEY=VALUE overrides, then the plan's."""
    import os

    import yaml

    best = best or next((c for c in result["candidates"] if c["fits"]), None)
    if best is None:
        raise ConfigError("no candidate fits, so there is no plan to write")
    data = apply_overrides({}, list(user_overrides) + best["overrides"])
    head = {"base": os.path.abspath(config_path) if config_path else "tiny.yaml"}
    t = best["time"]
    note = (
        f"# meshpar plan: {result['devices']} x {result['hardware']['name']}, predicted {t['step_s']:.4g} s/step, "
        f"MFU {t['mfu']:.2f}, {best['memory']['total'] / GiB:.2f} GiB/device\n"
    )
    return note + yaml.safe_dump({**head, **data}, sort_keys=False, default_flow_style=None)


def render(result: dict, console, top: int = 10) -> None:
    """The ranked table: mesh, strategy, memory breakdown, step time, MFU, why each lost."""
    from rich.table import Table

    hw = result["hardware"]
    console.print(
        f"[bold]model[/] {result['model']['params'] / 1e9:.3g}B params  [bold]hardware[/] "
        f"{result['devices']} x {hw['name']} ({hw['memory_bytes'] / GiB:.0f} GiB, "
        f"{hw['peak_flops'] / 1e12:.0f} TFLOP/s, matmuls at {hw['efficiency']:.0%})  [bold]batch[/] "
        f"{result['batch']['global_size']} x {result['batch']['length']}  "
        f"[bold]searched[/] {result['searched']}, costed {result.get('costed', result['searched'])}, "
        f"{result['fitting']} fit" + (f"  [bold]pinned[/] {' '.join(result['pinned'])}" if result.get("pinned") else "")
    )
    t = Table(title="plans, best first (memory in GiB per device)")
    for col in (
        "#",
        "mesh",
        "strategy",
        "remat",
        "mb",
        "params",
        "grads",
        "opt",
        "act",
        "work",
        "total",
        "step s",
        "MFU",
        "why",
    ):
        t.add_column(col, justify="right" if col not in ("mesh", "strategy", "remat", "why") else "left")
    for i, c in enumerate(result["candidates"][:top] if top else result["candidates"]):
        m = c["memory"]
        mb = (
            f"{c['pipeline']['schedule']} M={c['pipeline']['microbatches']}"
            if c["pipeline"]
            else str(c["microbatches"])
        )
        t.add_row(
            str(i + 1),
            " ".join(f"{a}={v}" for a, v in c["mesh"].items() if v > 1)
            + ("" if not c["dcn"] else " | dcn " + " ".join(f"{a}={v}" for a, v in c["dcn"].items())),
            c["strategy"],
            c["remat"],
            mb,
            *(f"{m[k] / GiB:.2f}" for k in ("params", "grads", "optimizer", "activations", "workspace", "total")),
            f"{c['time']['step_s']:.4g}",
            f"{c['time']['mfu']:.2f}",
            c["why"],
        )
    console.print(t)


def estimate(cfg, hardware=None, compiler: str | None = None, bytes_per_param=None, waits_for: tuple = ()) -> dict:
    """The planner's prediction for the plan `cfg` already names (for `train` / `inspect`); `compiler`
    "cpu" predicts what XLA:CPU compiles for fake devices (`plan --verify` without a target), default
    the hardware's own (`meshpar.plan.costmodel`: which buffers each compiler holds);
    `bytes_per_param` (W, G, O) as `plan`'s, default what the precision policy stores; `waits_for`
    as `steptime.evaluate`'s."""
    import numpy as np

    ici, dcn_cfg = split_sizes(cfg.mesh, cfg.devices)
    sizes = tuple(ici[a] * dcn_cfg[a] for a in MESH_AXES)
    cand = Candidate(
        sizes,
        tuple(dcn_cfg[a] for a in MESH_AXES),
        cfg.strategy,
        cfg.model.remat,
        cfg.batch.microbatches,
        cfg.pipeline.microbatches if ici["pipeline"] * dcn_cfg.get("pipeline", 1) > 1 else 1,
        cfg.pipeline.schedule,
        cfg.pipeline.virtual_stages,
    )
    c = np.dtype(get_policy(cfg.precision).compute_dtype).itemsize
    return evaluate(
        ModelFacts.from_config(cfg),
        cand,
        hardware or HW["h100"],
        Resolver(cfg.rules),
        bytes_per_param or parse_bytes_per_param(None, cfg.precision),
        c,
        compiler,
        waits_for,
    )
