"""Pipelined decoding (`meshpar/parallel/pipeline_decode.py`): decode tokens/s with P stages kept busy
by one group of slots each, in flight across generate calls (P ticks per call, or 1), against the pipe filled and
drained in every call with M microbatches (M = 1: the whole batch through one stage at a time), and against the same
model on the same devices without a pipeline (P = 1).

    python bench/bench_serve_pipeline.py                     # 8 fake CPU devices: pipeline=4 x tensor=2
    python bench/bench_serve_pipeline.py --stages 2 --slots 32

A pipelined decode call is one SPMD program: every stage computes every tick. In flight, a call is
T ticks of B/P rows per stage and gives T B/P tokens; filled and drained, it is (M + P - 1) ticks of
B/M rows and gives B tokens. tokens/s = tokens out / seconds over `--steps` x P calls (each reading
its tokens back, as serving does), after one compiling round; one run, all meshes side by side.
Prints one JSON object per configuration and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
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
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax
    import numpy as np

    from meshpar.core.config import load_config
    from meshpar.serve.engine import Engine

    model = [
        "model.layers=8",
        f"model.embed={args.embed}",
        "model.heads=8",
        "model.kv_heads=8",
        f"model.head_dim={args.embed // 8}",
        f"model.mlp={4 * args.embed}",
        "model.vocab=1024",
        "precision=fp32",
        f"serve.slots={args.slots}",
        "serve.cache_length=128",
        "mesh.data=1",
        "mesh.fsdp=1",
    ]
    tensor = args.devices // args.stages
    pipe = [f"mesh.pipeline={args.stages}", f"mesh.tensor={tensor}"]
    runs = [
        ("no pipeline", [f"mesh.tensor={args.devices}"], None, {}),
        (f"pipeline={args.stages}, in flight, {args.stages} ticks per call", pipe, None, {}),
        (f"pipeline={args.stages}, in flight, 1 tick per call", pipe, None, {"ticks": 1}),
    ]
    m = 1
    while m <= args.slots:
        runs.append(
            (f"pipeline={args.stages}, filled and drained", [*pipe, f"pipeline.microbatches={m}"], m, {"flush": True})
        )
        m *= 2
    rows, weights = [], None
    for name, mesh, micro, kw in runs:
        eng = Engine(load_config(None, [*model, *mesh]), info=lambda msg: None, weights=weights, **kw)
        weights = weights or jax.tree.map(np.asarray, eng.weights)
        state = eng.new_state()
        for slot in range(eng.slots):
            entry, _, _ = eng.prefill([1 + slot, 2, 3])
            state = eng.insert(entry, state, slot)
        calls = args.stages // eng.ticks if eng.in_flight else 1  # a round: every slot gets one token
        for _ in range(calls):  # compile, and fill the pipe
            state, toks, _ = eng.generate(state)
            np.asarray(toks)
        out, t0 = 0, time.perf_counter()
        for _ in range(args.steps * calls):
            state, toks, _ = eng.generate(state)
            out += int((np.asarray(toks) >= 0).sum())
        seconds = time.perf_counter() - t0
        rec = {
            "mesh": name,
            "microbatches": micro,
            "slots": eng.slots,
            "call_ms": 1000 * seconds / (args.steps * calls),
            "tokens": out,
            "tokens_per_s": out / seconds,
        }
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    base = rows[0]
    print("\n| mesh | microbatches | ms per call | tokens/s | vs no pipeline |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mesh']} | {r['microbatches'] or '-'} | {r['call_ms']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {r['tokens_per_s'] / base['tokens_per_s']:.2f}x |"
        )


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
