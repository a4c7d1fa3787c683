"""Peak per-device temporary memory of the pipelined train step, per schedule (XLA memory_analysis).

    python bench/bench_pipeline.py                 # P = 2 and 4, M = 4P and 8P, markdown table
    python bench/bench_pipeline.py --stages 2 --json

The microbatch (b sequences) is fixed and the mini-batch is M x b, so doubling M doubles the work:
GPipe stashes one stage input [b, T, E] per microbatch (M of them) while 1F1B holds at most 2P - 1 in
flight, so 1F1B's temporary memory should barely move with M and GPipe's should grow ~linearly.
Nothing runs: every number is from compiling one train step on fake CPU devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join(_flags + ["--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402

from meshpar.core.config import load_config  # noqa: E402
from meshpar.parallel import schedules  # noqa: E402
from meshpar.plan.inspect import memory  # noqa: E402
from meshpar.train.step import Trainer  # noqa: E402

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
    "strategy=fsdp_tp",
]


def measure(schedule: str, p: int, m: int, micro: int, v: int) -> dict:
    overrides = MODEL + [
        f"mesh.pipeline={p}",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "mesh.expert=1",
        f"pipeline.schedule={schedule}",
        f"pipeline.microbatches={m}",
        f"pipeline.virtual_stages={v if schedule == 'interleaved' else 1}",
        f"batch.global_size={m * micro}",
    ]
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, devices=jax.devices()[:p])
    mem = memory(trainer.compile())
    table = schedules.schedule_table(schedule, p, m, v if schedule == "interleaved" else 1)
    return {
        "schedule": schedule,
        "P": p,
        "M": m,
        "v": v if schedule == "interleaved" else 1,
        "micro": micro,
        "temp_bytes": mem["temp"],
        "bubble": schedules.bubble_fraction(table),
        "max_in_flight": max(schedules.in_flight(table)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--micro", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for p in args.stages:
        for m in (4 * p, 8 * p):
            for schedule in schedules.SCHEDULES:
                rows.append(measure(schedule, p, m, args.micro, args.virtual))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| P | M | schedule | v | bubble | max in flight | temp MiB/device | vs M=4P: x | vs M=4P: + MiB |")
    print("|---|---|----------|---|--------|---------------|-----------------|------------|----------------|")
    base = {(r["P"], r["schedule"]): r["temp_bytes"] for r in rows if r["M"] == 4 * r["P"]}
    for r in rows:
        b = base[(r["P"], r["schedule"])]
        print(
            f"| {r['P']} | {r['M']} | {r['schedule']} | {r['v']} | {r['bubble']:.3f} | {r['max_in_flight']} | "
            f"{r['temp_bytes'] / 2**20:.2f} | {r['temp_bytes'] / b:.2f} | {(r['temp_bytes'] - b) / 2**20:+.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
