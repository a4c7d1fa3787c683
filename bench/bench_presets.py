"""Steady-state step time and tokens/s of the default config (configs/tiny.yaml) under each preset.

    python bench/bench_presets.py [--steps 20] [--warmup 3] [--out bench/RESULTS.md]

All presets run in one process, side by side, on the same fake devices, so ratios are comparable
(absolute numbers on fake CPU devices say little about accelerators). Each preset gets the mesh it
is meant for. Results are printed as a Markdown table (and appended to --out if given).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from meshpar.core.mesh import fake_cpu_devices

CASES = [
    ("dp", {"data": 8}),
    ("zero1", {"data": 8}),
    ("zero2", {"data": 8}),
    ("fsdp", {"data": 2, "fsdp": 4}),
    ("hsdp", {"data": 2, "fsdp": 4}),
    ("tp", {"data": 2, "tensor": 4}),
    ("tp_sp", {"data": 2, "tensor": 4}),
    ("fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("overrides", nargs="*", help="extra KEY=VALUE config overrides for every preset")
    args = ap.parse_args()
    fake_cpu_devices(8)
    import jax

    from meshpar.core.config import load_config
    from meshpar.train.batches import Batches
    from meshpar.train.data import make_source
    from meshpar.train.step import Trainer

    rows = []
    for strategy, mesh in CASES:
        sizes = [f"mesh.{a}={mesh.get(a, 1)}" for a in ("data", "fsdp", "tensor", "pipeline", "expert")]
        cfg = load_config(None, [f"strategy={strategy}", *sizes, *args.overrides])
        tr = Trainer(cfg)
        t0 = time.perf_counter()
        step = tr.compile()
        compile_s = time.perf_counter() - t0
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
            state, m = step(state, b)
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for b in batches[args.warmup :]:
            state, m = step(state, b)
        jax.block_until_ready(m)
        dt = (time.perf_counter() - t0) / args.steps
        tokens = cfg.batch.global_size * cfg.batch.length
        mesh_str = " x ".join(f"{a}={s}" for a, s in mesh.items())
        rows.append((strategy, mesh_str, dt * 1e3, tokens / dt, compile_s))
        print(
            f"{strategy:8s} {mesh_str:28s} {dt * 1e3:8.1f} ms/step {tokens / dt:10,.0f} tok/s  "
            f"compile {compile_s:.1f}s",
            flush=True,
        )
    base = rows[0][3]
    table = ["| preset | mesh | step time (ms) | tokens/s | vs dp | compile (s) |", "|---|---|---:|---:|---:|---:|"]
    table += [f"| {s} | {m} | {t:.1f} | {tps:,.0f} | {tps / base:.2f} | {c:.1f} |" for s, m, t, tps, c in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(
                f"\n### Presets, default tiny config ({time.strftime('%Y-%m-%d')})\n\n"
                f"Command: `python bench/bench_presets.py --steps {args.steps} --warmup {args.warmup}"
                f"{' ' + ' '.join(args.overrides) if args.overrides else ''}`  \n"
                f"Machine: {platform.processor() or platform.machine()}, 8 fake CPU devices, "
                f"jax {jax.__version__}, python {sys.version.split()[0]}\n\n{text}\n"
            )


if __name__ == "__main__":
    main()
