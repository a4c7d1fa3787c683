"""What a pipeline schedule recomputes: step time and temporary memory of GPipe (each stage
rematerialised, its forward rerun in the backward) against 1F1B (each forward's residuals kept for
its backward, nothing rerun), per remat policy.

    python bench/bench_pipeline_recompute.py [--steps 5] [--warmup 2] [--stages 2] [--micro 4]

Both schedules run side by side in one process on the same fake CPU devices, the same model and
the same M = 4P microbatches of `micro` sequences, so their ratio is the measurement (absolute
times on fake CPU devices say little about accelerators). Expected on a compute-bound backend:
GPipe does one more forward of the layers than 1F1B (4 passes against 3 under `none`, 5 against 4
under `full`), and 1F1B's temporaries grow with what the policy saves, times up to 2P - 1
microbatches in flight.
"""

from __future__ import annotations

import argparse
import sys
import time

from meshpar.core.mesh import fake_cpu_devices

MODEL = [
    "model.layers=8",
    "model.embed=128",
    "model.mlp=512",
    "model.heads=4",
    "model.kv_heads=4",
    "model.head_dim=32",
    "model.vocab=256",
    "batch.length=128",
    "precision=fp32",
    "strategy=dp",
]


def run(schedule: str, remat: str, p: int, m: int, micro: int, steps: int, warmup: int) -> dict:
    import jax

    from meshpar.core.config import load_config
    from meshpar.plan.inspect import memory
    from meshpar.train.batches import Batches
    from meshpar.train.data import make_source
    from meshpar.train.step import Trainer

    cfg = load_config(
        None,
        MODEL
        + [
            f"mesh.pipeline={p}",
            "mesh.data=1",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "mesh.expert=1",
            f"model.remat={remat}",
            f"pipeline.schedule={schedule}",
            f"pipeline.microbatches={m}",
            f"batch.global_size={m * micro}",
        ],
    )
    tr = Trainer(cfg, devices=jax.devices()[:p])
    step = tr.compile()
    temp = memory(step)["temp"]
    state = tr.init()
    data = Batches(
        make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab),
        tr.batch_sharding,
        cfg.batch.global_size,
        cfg.batch.length,
        cfg.data.seed,
    )
    batches = [next(data) for _ in range(warmup + steps)]
    for b in batches[:warmup]:
        state, met = step(state, b)
    jax.block_until_ready(met)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        state, met = step(state, b)
    jax.block_until_ready(met)
    return {
        "schedule": schedule,
        "remat": remat,
        "step_s": (time.perf_counter() - t0) / steps,
        "temp": temp,
        "loss": float(met["loss"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="sequences per microbatch")
    args = ap.parse_args(argv)
    fake_cpu_devices(8)
    p, m = args.stages, 4 * args.stages
    rows = []
    for remat in ("none", "save_dots", "full"):
        pair = [run(s, remat, p, m, args.micro, args.steps, args.warmup) for s in ("gpipe", "1f1b")]
        rows.append(pair)
        for r in pair:
            print(
                f"{r['schedule']:6s} {remat:9s} {r['step_s'] * 1e3:8.1f} ms/step  temp {r['temp'] / 2**20:7.2f} MiB"
                f"  loss {r['loss']:.4f}",
                file=sys.stderr,
                flush=True,
            )
    print(f"P={p}, M={m}, {args.micro} sequences per microbatch, {args.steps} timed steps after {args.warmup}\n")
    print("| remat | GPipe ms/step | 1F1B ms/step | 1F1B / GPipe time | GPipe temp MiB | 1F1B temp MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for g, f in rows:
        print(
            f"| {g['remat']} | {g['step_s'] * 1e3:.1f} | {f['step_s'] * 1e3:.1f} | {f['step_s'] / g['step_s']:.2f} | "
            f"{g['temp'] / 2**20:.2f} | {f['temp'] / 2**20:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
