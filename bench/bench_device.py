"""The training step on a real accelerator against what meshpar predicted for it without one.

    python bench/bench_device.py [--steps 5] [--warmup 2] [--cases 1b,l3-8L] [--profile l3-8L] [--json F]

For each case (one device, bf16, remat full, as `meshpar plan` costs them) it runs the real step and
reports, side by side:

- the step time and MFU (model FLOPs, 6N plus attention, `meshpar.train.flops`, at the device's
  datasheet peak) beside the planner's step time (`meshpar.plan.search.estimate`) and the compute
  roofline: the FLOPs the step executes (the model's plus its recomputation, as the planner counts
  them) at the datasheet peak. XLA:GPU's `cost_analysis()` counts no FLOPs inside library calls
  (cuBLAS, cuDNN), so its figures are kept in the JSON but not used;
- the runtime peak (`memory_stats()['peak_bytes_in_use']`) beside the compiled program's peak
  (argument + output + temp - alias) and the planner's total;
- with `--profile CASE`, where the step's device time goes: a `jax.profiler` trace of two steps,
  its GPU kernels summed by kind (matmul, attention, fusions, copies) and the top kernels.

Each case runs in its own process, so each runtime peak is its own. A bf16 matmul of 8192^3 first
gives the peak this device reaches. Needs an accelerator: on CPU it says so and exits 0 (the GPU
issue's checks are run on a lent machine; `--allow-cpu` with `--cases tiny` rehearses the script).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

LLAMA3_8B = ["model.size=7b", "model.kv_heads=8", "model.mlp=14336", "model.vocab=128256", "model.rope_theta=500000"]
COMMON = [
    "strategy=fsdp",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "precision=bf16",
    "model.remat=full",
    "batch.microbatches=1",
]
CASES = {  # name -> overrides; on one 80 GB H100 the largest Llama-3 8B that trains keeps 8 of its 32 layers,
    # the whole 8B (16 B x 8.0B of state, 124 GiB compiled) trains on one 141 GB H200
    "1b": ["model.size=1b", "batch.length=4096", "batch.global_size=8"],
    "1b-v128k": ["model.size=1b", "model.vocab=128256", "batch.length=4096", "batch.global_size=8"],  # logits the peak
    "l3-8L": [*LLAMA3_8B, "model.layers=8", "batch.length=4096", "batch.global_size=4"],
    "l3-8L-8k": [*LLAMA3_8B, "model.layers=8", "batch.length=8192", "batch.global_size=2"],
    "l3-8b": [*LLAMA3_8B, "batch.length=4096", "batch.global_size=4"],
    "l3-8b-8k": [*LLAMA3_8B, "batch.length=8192", "batch.global_size=2"],
    "tiny": ["model.size=tiny", "batch.length=256", "batch.global_size=4"],
}
KINDS = (  # kernel name fragments -> what the kernel does (first match wins)
    ("attention", ("cudnn", "fmha", "flash", "fprop", "bprop", "dot_product_attention")),
    ("matmul", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "sm90_", "wgmma", "matmul")),
    ("copy", ("memcpy", "memset", "copy", "transpose")),
    ("reduce", ("reduce", "reduction")),
    ("fusion", ("fusion", "loop_", "input_", "triton")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, parts in KINDS:
        if any(p in low for p in parts):
            return kind
    return "other"


def peak_matmul(jax, jnp) -> float:
    """TFLOP/s of a bf16 [8192, 8192] x [8192, 8192] product (mean of 10 after 3 warm-ups)."""
    n = 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    for _ in range(3):
        f(a, b).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        out = f(a, b)
    out.block_until_ready()
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def profile_summary(trace_dir: str, steps: int, top: int = 25) -> dict:
    """GPU kernel time of a `jax.profiler` trace, by kind and by kernel, per step (`jax.profiler.ProfileData`)."""
    import glob

    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {"error": f"no .xplane.pb under {trace_dir}"}
    data = ProfileData.from_file(files[0])
    lines_seen, by_kind, by_kernel, by_op = {}, defaultdict(float), defaultdict(float), defaultdict(float)
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            events = list(line.events)
            total = sum(e.duration_ns for e in events)
            lines_seen[f"{plane.name} | {line.name}"] = {"events": len(events), "ms": total / 1e6 / steps}
            lname = line.name.lower()
            if "xla ops" in lname:
                for e in events:
                    by_op[e.name] += e.duration_ns
            elif "stream" in lname:
                for e in events:
                    by_kernel[e.name] += e.duration_ns
                    by_kind[kind_of(e.name)] += e.duration_ns
    ms = lambda d: {k: round(v / 1e6 / steps, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}  # noqa: E731
    return {
        "lines": lines_seen,
        "kernel_ms_per_step": round(sum(by_kernel.values()) / 1e6 / steps, 2),
        "by_kind_ms": ms(by_kind),
        "top_kernels_ms": ms(by_kernel),
        "top_ops_ms": ms(by_op),
    }


def run_case(name: str, args) -> dict:
    """One case in this process: compile, run, measure (see the module docstring)."""
    import jax

    from meshpar.core.config import load_config
    from meshpar.plan import inspect
    from meshpar.plan.hardware import PRESETS
    from meshpar.plan.program import kernels
    from meshpar.plan.search import estimate
    from meshpar.train.batches import Batches
    from meshpar.train.data import make_source
    from meshpar.train.step import trainer_for

    dev = jax.devices()[0]
    hw = PRESETS["h200" if "H200" in dev.device_kind else "h100"]
    cfg = load_config(None, [*COMMON, *CASES[name], *args.overrides])
    cfg.devices = 1
    pred = estimate(cfg, hw)
    tr = trainer_for(cfg, devices=[dev])
    t0 = time.perf_counter()
    compiled = tr.compile()
    compile_s = time.perf_counter() - t0
    mem = inspect.memory(compiled)
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})
    hlo = compiled.as_text()
    state = tr.init()
    data = Batches(
        make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab),
        tr.batch_sharding,
        cfg.batch.global_size,
        cfg.batch.length,
        cfg.data.seed,
    )
    batches = [next(data) for _ in range(args.warmup + args.steps)]
    for b in batches[: args.warmup]:
        state, m = tr.step(state, b)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for b in batches[args.warmup :]:
        state, m = tr.step(state, b)
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t0) / args.steps
    out = {
        "case": name,
        "overrides": CASES[name],
        "device": dev.device_kind,
        "jax": jax.__version__,
        "compile_s": round(compile_s, 1),
        "step_s": step_s,
        "loss": float(m["loss"]),
        "model_flops": tr.model_flops()[0],
        "hlo_flops": ca.get("flops"),
        "hlo_bytes": ca.get("bytes accessed"),
        "peak_flops": hw.peak_flops,
        "hbm_bw": (hw.target or {}).get("memory_bandwidth"),
        "compiled_peak": mem.get("peak_estimate"),
        "compiled_memory": mem,
        "runtime_peak": (dev.memory_stats() or {}).get("peak_bytes_in_use"),
        "pred_total": pred["memory"]["total"],
        "pred_memory": pred["memory"],
        "pred_step_s": pred["time"]["step_s"],
        "pred_mfu": pred["time"]["mfu"],
        "efficiency": hw.efficiency,
        "kernels": kernels(hlo),
    }
    out["mfu"] = out["model_flops"] / (step_s * hw.peak_flops)
    out["pred_compute_s"] = pred["time"]["compute_s"]
    out["pred_flops"] = pred["time"]["flops"]
    if args.profile == name:
        trace = os.path.join(args.trace_dir, name)
        with jax.profiler.trace(trace):
            for b in batches[:2]:
                state, m = tr.step(state, b)
            jax.block_until_ready(m)
        out["profile"] = profile_summary(trace, 2)
        out["profile"]["step_ms"] = round(step_s * 1e3, 2)
    return out


def roofline_s(r: dict) -> float:
    """The executed FLOPs at the datasheet peak (rows saved before the planner's roofline model: its
    compute time at the flat efficiency it assumed then)."""
    if "pred_flops" in r:
        return r["pred_flops"] / r["peak_flops"]
    return r.get("pred_compute_s", r["pred_step_s"]) * r["efficiency"]


def table(rows: list[dict], peak_tflops: float | None) -> str:
    gib = 2**30
    lines = [
        f"Measured bf16 matmul 8192^3: {peak_tflops:.0f} TFLOP/s" if peak_tflops else "",
        "",
        "| case | step (ms) | MFU | planner step (ms) | measured/planner | roofline (ms) | runtime peak (GiB) "
        "| compiled peak (GiB) | runtime/compiled | planner total (GiB) | planner/runtime | compile (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} |")
            continue
        rt, cp = r["runtime_peak"] or 0, r["compiled_peak"] or 0
        lines.append(
            f"| {r['case']} | {r['step_s'] * 1e3:.1f} | {r['mfu']:.3f} | {r['pred_step_s'] * 1e3:.1f} | "
            f"{r['step_s'] / r['pred_step_s']:.2f} | {roofline_s(r) * 1e3:.1f} | {rt / gib:.2f} | {cp / gib:.2f} | "
            f"{rt / cp if cp else 0:.3f} | {r['pred_total'] / gib:.2f} | {r['pred_total'] / rt if rt else 0:.2f} | "
            f"{r['compile_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cases", default="1b,l3-8L,l3-8L-8k", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--profile", default="l3-8L", help="the case to trace (two steps); '' for none")
    ap.add_argument("--trace-dir", default="/tmp/meshpar-bench-device")
    ap.add_argument("--json", help="write every row (and the profile) as JSON here")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per case")
    ap.add_argument("--allow-cpu", action="store_true")
    ap.add_argument("--table", metavar="JSON", help="print the table of an earlier run's --json and exit")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child process's one case
    ap.add_argument("overrides", nargs="*", help="extra KEY=VALUE config overrides for every case")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        print(table(saved["rows"], (saved.get("probe") or {}).get("matmul_tflops")))
        return
    if args.case == "probe":
        import jax
        import jax.numpy as jnp

        dev = jax.devices()[0]
        peak = peak_matmul(jax, jnp) if dev.platform != "cpu" else None
        print(
            "ROW "
            + json.dumps(
                {"platform": dev.platform, "device": dev.device_kind, "jax": jax.__version__, "matmul_tflops": peak}
            ),
            flush=True,
        )
        return
    if args.case:
        print("ROW " + json.dumps(run_case(args.case, args)), flush=True)
        return
    # every measurement in a child of its own: its runtime peak is its own, and this process holds no device memory
    from meshpar.runtime.xla_flags import with_gpu_flags

    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"),
        "XLA_FLAGS": with_gpu_flags(os.environ.get("XLA_FLAGS", "")),  # what `meshpar train` runs a GPU with
    }

    def child(name: str) -> dict:
        cmd = [
            sys.executable,
            __file__,
            "--case",
            name,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--profile",
            args.profile,
            "--trace-dir",
            args.trace_dir,
            *args.overrides,
        ]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            row = next((json.loads(x[4:]) for x in p.stdout.splitlines() if x.startswith("ROW ")), None)
            err = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
        except subprocess.TimeoutExpired:
            row, err = None, f"timed out after {args.timeout} s"
        return row or {"case": name, "error": err}

    probe = child("probe")
    if probe.get("platform", "cpu") == "cpu" and not args.allow_cpu:
        print(
            f"bench_device: no accelerator here ({probe.get('error') or 'jax sees only CPU devices'}); "
            "run it where a GPU or TPU is"
        )
        return
    peak = probe.get("matmul_tflops")
    print(
        f"{probe['device']}, jax {probe['jax']}, python {sys.version.split()[0]}"
        + (f"; bf16 matmul 8192^3: {peak:.0f} TFLOP/s" if peak else ""),
        flush=True,
    )
    rows = []
    for name in args.cases.split(","):
        row = child(name)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "profile")}), flush=True)
        if "profile" in row:
            print(json.dumps(row["profile"], indent=1), flush=True)
    print(table(rows, peak))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"probe": probe, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
