"""Pod dry run: compile a plan for its real device count on fake CPU devices and put the
planner's numbers next to the compiler's.

    rows = verify(result, config_path, overrides, k=1)    # `meshpar plan --verify 1`
    pred, comp = compare(cfg)                              # one config: prediction vs compiled

What is compared (per device, per step):
* memory: the planner's total (params + grads + optimizer + activations) against XLA's
  `memory_analysis()` peak (`meshpar.plan.inspect.memory`), and params + optimizer + batch
  against the argument bytes (the train state and the batch are exactly the step's arguments);
* collectives: bytes per kind against the compiled HLO as `meshpar inspect` reads it.
The CPU compile runs XLA's SPMD partitioner and buffer assignment like a GPU/TPU one, but codegen
at optimisation level 0 (the numbers compared do not depend on it; compiling is ~2x faster).

XLA:CPU computes bf16/fp16 matmuls in f32 (every dot's output, and so the activations, are f32: a
bf16 step compiles to the fp32 step's peak, 8.49 vs 8.54 GiB for 125m dp, batch 16 x 1024), and
holds buffers XLA:GPU and libtpu do not (`meshpar.plan.costmodel`'s "cpu" rules). On CPU the compile
therefore checks the planner's XLA:CPU prediction at f32 compute, and the verdict for the target is
    target peak = compiled CPU peak x predicted(plan, target) / predicted(plan at fp32, XLA:CPU),
the compiled step's ratio to the planner carried over to the target. Both figures are reported;
`fits_compiled` uses the target's. With `--target` the target's own compile is the verdict.
"""

from __future__ import annotations

import jax

from meshpar.core.config import load_config
from meshpar.core.errors import MeshparError
from meshpar.core.precision import get_policy
from meshpar.plan import inspect
from meshpar.plan.collectives import summarize
from meshpar.plan.search import estimate
from meshpar.plan.target import DoesNotFit
from meshpar.train.step import trainer_for

COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_step(cfg, target=None):
    """(trainer, compiled step) for `cfg` on the first cfg.devices devices, or on a deviceless `target`'s
    devices by its own compiler (`meshpar.plan.target`)."""

    if target is not None:
        from meshpar.plan.target import compile_errors, compile_trainer  # local: compilers for a --target only

        with compile_errors(target, cfg):
            trainer = trainer_for(cfg, devices=target.devices)
            return trainer, compile_trainer(target, trainer)[0]
    if jax.device_count() < cfg.devices:
        raise MeshparError(
            f"--verify needs {cfg.devices} devices, JAX has {jax.device_count()}; on a CPU host "
            f"run `meshpar plan --devices {cfg.devices} ...` (it fakes them before JAX starts)"
        )
    trainer = trainer_for(cfg, devices=jax.devices()[: cfg.devices])
    return trainer, trainer.lower().compile(COMPILE_OPTIONS)


def compiled_numbers(trainer, compiled) -> dict:
    shape = trainer.describe()["mesh"]
    summary = inspect.summarize(inspect.collectives(compiled.as_text(), shape))
    return {"memory": inspect.memory(compiled), "collectives": {k: v["bytes"] for k, v in summary.items()}}


def compare(cfg, hardware=None) -> tuple[dict, dict]:
    """(prediction, compiled) for the plan `cfg` names."""

    pred = estimate(cfg, hardware, compiler="cpu")
    trainer, compiled = compile_step(cfg)
    pred = {"memory": pred["memory"], "collectives": summarize(pred["collectives"]), "time": pred["time"]}
    return pred, compiled_numbers(trainer, compiled)


def verify(result: dict, config_path: str | None, overrides: list[str], k: int, target=None) -> list[dict]:
    """Compile the top `k` plans of `result` and report predicted vs compiled side by side. A plan
    whose compiled peak exceeds the device's memory is marked as not fitting. With a `target` each plan
    is compiled for the target's devices by its compiler, whose peak is the verdict itself."""

    rows = []
    mem_limit = result["hardware"]["memory_bytes"]
    for rank, cand in enumerate(result["candidates"][:k], 1):
        cfg = load_config(config_path, list(overrides) + cand["overrides"])
        try:
            trainer, compiled = compile_step(cfg, target)
        except DoesNotFit as e:  # libtpu's verdict at compile time: this plan's row says so, the rest go on
            rows.append(_refused(rank, cand, e, target))
            continue
        got = compiled_numbers(trainer, compiled)
        peak = on_target = got["memory"].get("peak_estimate", 0)
        predicted = cand["memory"]
        if target is None:  # XLA:CPU's step: compared with the planner's XLA:CPU rules, carried to the target
            f32 = ["precision=fp32"] if _upcast_on_cpu(cfg.precision) else []  # what XLA:CPU computes in
            predicted = estimate(load_config(config_path, list(overrides) + cand["overrides"] + f32), compiler="cpu")[
                "memory"
            ]
            on_target = peak * cand["memory"]["total"] / predicted["total"]
        rows.append(
            {
                "rank": rank,
                "mesh": cand["mesh"],
                "strategy": cand["strategy"],
                "overrides": cand["overrides"],
                "predicted": {"memory": predicted, "collectives": cand["collectives"]},
                "compiled": got,
                "target_peak": int(on_target),
                "fits_compiled": on_target <= mem_limit,
                "compiled_by": target.describe()["device_kind"] if target else "XLA:CPU",
            }
        )
    return rows


def _refused(rank: int, cand: dict, e, target) -> dict:
    """The row of a plan the target's compiler refused as too large (`meshpar.plan.target.DoesNotFit`):
    the bytes it asked for per chip stand in for the compiled peak."""
    memory = {"argument": e.arguments, "temp": e.temp or 0, "peak_estimate": int(e.needed)}
    return {
        "rank": rank,
        "mesh": cand["mesh"],
        "strategy": cand["strategy"],
        "overrides": cand["overrides"],
        "predicted": {"memory": cand["memory"], "collectives": cand["collectives"]},
        "compiled": {"memory": memory, "collectives": {}},
        "target_peak": int(e.needed),
        "fits_compiled": False,
        "compiled_by": target.describe()["device_kind"],
        "refused": str(e),
    }


def _upcast_on_cpu(precision: str) -> bool:
    """True when this compile computes matmuls in f32 that the target computes in 16 bits."""
    import numpy as np

    return jax.default_backend() == "cpu" and np.dtype(get_policy(precision).compute_dtype).itemsize == 2


def render(rows: list[dict], console) -> None:
    """One table per plan: each quantity with its predicted and compiled value and their ratio."""
    from rich.table import Table

    gib = 2**30
    for r in rows:
        mesh = " ".join(f"{a}={v}" for a, v in r["mesh"].items() if v > 1)
        t = Table(
            title=f"#{r['rank']} {r['strategy']} {mesh}: predicted vs compiled for {r['compiled_by']} "
            "(per device, per step)" + ("" if r["fits_compiled"] else "  [bold red]compiled: does not fit[/]")
        )
        for col in ("quantity", "predicted", "compiled", "ratio"):
            t.add_column(col, justify="left" if col == "quantity" else "right")
        pm, cm = r["predicted"]["memory"], r["compiled"]["memory"]
        pairs = [("memory total (GiB) / peak", pm["total"] / gib, cm.get("peak_estimate", 0) / gib)]
        if r["target_peak"] != cm.get("peak_estimate", 0):
            pairs.append(
                (
                    "  peak on the target (CPU computes matmuls in f32; scaled to 16-bit; the verdict)",
                    pm["total"] / gib,
                    r["target_peak"] / gib,
                )
            )
        pairs.append(
            (
                "params+optimizer+batch / arguments (GiB)",
                (pm["params"] + pm["optimizer"]) / gib,
                cm.get("argument", 0) / gib,
            )
        )
        kinds = sorted(set(r["predicted"]["collectives"]) | set(r["compiled"]["collectives"]))
        pairs += [
            (
                f"{kind} (MB)",
                r["predicted"]["collectives"].get(kind, 0) / 1e6,
                r["compiled"]["collectives"].get(kind, 0) / 1e6,
            )
            for kind in kinds
        ]
        for name, p, c in pairs:
            t.add_row(name, f"{p:,.3f}", f"{c:,.3f}", f"{p / c:.2f}" if c else "-")
        console.print(t)
