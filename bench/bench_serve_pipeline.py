"""Pipelined decoding (`meshpar/parallel/pipeline_decode.py`): decode tokens/s with the slots cut into M
microbatches that follow each other through P stages, against M = 1 (the whole batch through one
stage at a time) on the same devices, and the same model on a mesh without a pipeline.

    python bench/bench_serve_pipeline.py                     # 8 fake CPU devices: pipeline=4 x tensor=2
    python bench/bench_serve_pipeline.py --stages 2 --slots 32

A pipelined decode step is one SPMD program: every stage computes every tick, on a microbatch or on
nothing useful, so a step costs (M + P - 1) ticks of B/M rows each; M = 1 costs P ticks of B rows.
Medians of `--steps` generate calls (each reading its tokens back, as serving does), one run.
Prints one JSON object per configuration and a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--embed", type=int, default=256, help="model width (MLP 4x)")
    args = p.parse_args()
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np
    from meshpar.core.config import load_config
    from meshpar.serve.engine import Engine

    model = ["model.layers=8", f"model.embed={args.embed}", "model.heads=8", "model.kv_heads=8",
             f"model.head_dim={args.embed // 8}", f"model.mlp={4 * args.embed}", "model.vocab=1024", "precision=fp32", f"serve.slots={args.slots}",
             "serve.cache_length=128", "mesh.data=1", "mesh.fsdp=1"]
    tensor = args.devices // args.stages
    runs = [("no pipeline", [f"mesh.tensor={args.devices}"], None)]
    m = 1
    while m <= args.slots:
        runs.append((f"pipeline={args.stages}", [f"mesh.pipeline={args.stages}", f"mesh.tensor={tensor}",
                                                  f"pipeline.microbatches={m}"], m))
        m *= 2
    rows, weights = [], None
    for name, mesh, micro in runs:
        eng = Engine(load_config(None, [*model, *mesh]), info=lambda msg: None, weights=weights)
        weights = weights or jax.tree.map(np.asarray, eng.weights)
        state = eng.new_state()
        for slot in range(eng.slots):
            entry, _, _ = eng.prefill([1 + slot, 2, 3])
            state = eng.insert(entry, state, slot)
        state, toks, _ = eng.generate(state)                  # compile
        np.asarray(toks)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, toks, _ = eng.generate(state)
            np.asarray(toks)
            times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        rec = {"mesh": name, "microbatches": micro, "slots": eng.slots, "step_s": step, "tokens_per_s": eng.slots / step}
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    base = next(r for r in rows if r["microbatches"] == 1)
    print("\n| mesh | microbatches | decode step ms | tokens/s | vs M = 1 |")
    print("|---|---|---|---|---|")
    for r in rows:
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if r["microbatches"] else "-"
        print(f"| {r['mesh']} | {r['microbatches'] or '-'} | {1000 * r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {vs} |")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
