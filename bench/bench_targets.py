"""The planner's memory against the target's own compile: deviceless H100 and TPU v5p programs.

    python bench/bench_targets.py [--quick] [--out bench/RESULTS.md]

Each row is one config compiled by the target's compiler (`meshpar.plan.program.report`, the same path
as `meshpar inspect --target`): the compiled peak per device (the compiler's own, `meshpar.plan.inspect.memory`)
beside the planner's total (`meshpar.plan.search.estimate` for the same hardware), their ratio, the
compile time and the kernels that matter. bf16, remat full, as `meshpar plan` costs them. Run once
`meshpar compilers --install` first.
"""

from __future__ import annotations

import argparse
import sys
import time

LLAMA3_8B = ["model.size=7b", "model.kv_heads=8", "model.mlp=14336", "model.vocab=128256", "model.rope_theta=500000"]
SIZES = {"125m": ["model.size=125m"], "1b": ["model.size=1b"], "7b": ["model.size=7b"], "8b": LLAMA3_8B}
MESH = {  # per preset, for 8 devices (64: the data-like axis x 8)
    "dp": {"data": 8},
    "zero1": {"data": 8},
    "fsdp": {"fsdp": 8},
    "fsdp_tp": {"fsdp": 2, "tensor": 4},
    "tp_sp": {"data": 2, "tensor": 4},
}
EXTRA = {  # name -> (preset, mesh, overrides)
    "gpipe": (
        "fsdp_tp",
        {"pipeline": 2, "fsdp": 2, "tensor": 2},
        ["pipeline.schedule=gpipe", "pipeline.microbatches=4"],
    ),
    "1f1b": ("fsdp_tp", {"pipeline": 2, "fsdp": 2, "tensor": 2}, ["pipeline.schedule=1f1b", "pipeline.microbatches=4"]),
    "context all_gather": (
        "fsdp",
        {"context": 4, "fsdp": 2},
        ["model.context_strategy=all_gather", "model.attention=flash"],
    ),
    "context ring": ("fsdp", {"context": 4, "fsdp": 2}, ["model.context_strategy=ring", "model.attention=flash"]),
    "moe capacity": ("fsdp", {"data": 1, "expert": 8}, ["model.name=moe", "moe.num_experts=8"]),
    "moe dropless": (
        "fsdp",
        {"data": 1, "expert": 8},
        ["model.name=moe", "moe.num_experts=8", "moe.capacity_factor=null"],
    ),
}


def mesh_overrides(mesh: dict, devices: int) -> list[str]:
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1, "context": 1, "expert": 1, **mesh}
    first = next(iter(mesh))
    sizes[first] *= devices // 8
    return [f"mesh.{a}={v}" for a, v in sizes.items()]


def cases(n: int, sizes=tuple(SIZES), length: int = 4096) -> list[tuple[str, list[str]]]:
    """The sweep's rows on `n` devices, (name, config overrides): each size under each preset of MESH,
    then 1b under EXTRA's layouts; bf16, two sequences of `length` tokens per device."""
    rows = [
        (f"{size} {p}", SIZES[size] + [f"strategy={p}"] + mesh_overrides(MESH[p], n)) for size in sizes for p in MESH
    ]
    rows += [
        (f"1b {name}", SIZES["1b"] + [f"strategy={p}"] + mesh_overrides(mesh, n) + extra)
        for name, (p, mesh, extra) in EXTRA.items()
    ]
    return [
        (name, ["precision=bf16", f"batch.length={length}", f"batch.global_size={2 * n}", *ov]) for name, ov in rows
    ]


def row(target, name: str, overrides: list[str]) -> dict:
    from meshpar.core.config import load_config
    from meshpar.plan.program import report
    from meshpar.plan.search import estimate
    from meshpar.plan.target import DoesNotFit

    start = time.perf_counter()
    pred = None
    try:
        cfg = load_config(None, overrides)
        cfg.devices = len(target.devices)
        pred = estimate(cfg, target.hardware)
        rep = report(cfg, target)
    except DoesNotFit as e:  # libtpu's verdict: the bytes it asked for stand in for the peak
        return {
            "name": name,
            "peak": e.needed,
            "pred": pred["memory"]["total"] if pred else None,
            "compile_s": time.perf_counter() - start,
            "kernels": "does not fit: libtpu refused it",
            "fits": False,
        }
    except Exception as e:  # noqa: BLE001 - a row that does not compile says why and the sweep goes on
        return {"name": name, "error": str(e).splitlines()[0][:120]}
    t = rep["target"]
    kernels = ", ".join(
        sorted(
            {
                k.split(":")[0] + (":" + k.split(":")[1].split("_")[0] if ":" in k else "")
                for k in t["kernels"]
                if not k.startswith("custom:")
            }
        )
    )
    return {
        "name": name,
        "peak": t["peak_bytes"],
        "pred": pred["memory"]["total"] if pred else None,
        "compile_s": time.perf_counter() - start,
        "kernels": kernels,
        "fits": t["fits"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 devices, 125m and 1b only")
    ap.add_argument("--only", help="comma-separated row names to run (e.g. '1b moe dropless')")
    ap.add_argument("--targets", default="h100,tpu-v5p")
    ap.add_argument("--devices", default="8,64")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    from meshpar.plan.target import resolve

    sizes = ["125m", "1b"] if args.quick else list(SIZES)
    counts = [8] if args.quick else [int(n) for n in args.devices.split(",")]
    lines = [
        "| target | devices | config | planner GiB | compiled peak GiB | planner / compiled | compile s | kernels |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gib = 2**30
    for hw in args.targets.split(","):
        for n in counts:
            target = resolve(hw, n)
            for name, ov in cases(n, sizes, args.length):
                if args.only and name not in args.only.split(","):
                    continue
                r = row(target, name, ov)
                if "error" in r:
                    line = f"| {hw} | {n} | {name} | - | - | - | - | refused: {r['error']} |"
                else:
                    ratio = f"{r['pred'] / r['peak']:.2f}" if r["pred"] and r["peak"] else "-"
                    line = (
                        f"| {hw} | {n} | {name} | {(r['pred'] or 0) / gib:.2f} | {r['peak'] / gib:.2f} | {ratio} | "
                        f"{r['compile_s']:.1f} | {r['kernels']} |"
                    )
                print(line, flush=True)
                lines.append(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
