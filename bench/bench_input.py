"""Is the input pipeline off the critical path? Step time with a constant device batch vs the real
source, side by side in one process.

    python bench/bench_input.py [--steps 20] [--rounds 6] [KEY=VALUE ...]

Variants (same compiled step, same state shapes, default tiny config unless overridden):
  constant   one device batch reused every step: no host data work at all (the floor)
  prefetch   meshpar.train.batches.Prefetch(Batches(real source)): what `meshpar train` does now
  inline     Batches(real source) built between steps (what the loop did before issue 13)
Each round runs `--steps` steps of every variant, dispatched back to back as the loop does (no
host sync between steps), then waits for the last; step time = round wall time / steps. The
variants alternate within each round so load from other processes hits them alike. Printed:
median step time per variant and its ratio to `constant`, plus the host time to build one batch.
"""

from __future__ import annotations

import argparse
import json
import time

from meshpar.core.mesh import fake_cpu_devices

fake_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshpar.core.config import load_config  # noqa: E402
from meshpar.train.batches import Batches, Prefetch  # noqa: E402
from meshpar.train.data import make_source  # noqa: E402
from meshpar.train.step import Trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(None, args.overrides)
    tr = Trainer(cfg)
    step = tr.compile()
    source = make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab)

    def batches(start):
        return Batches(source, tr.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed, step=start)

    t = time.perf_counter()
    probe = batches(10_000)
    jax.block_until_ready([next(probe) for _ in range(10)])
    build_ms = 1e3 * (time.perf_counter() - t) / 10
    const = next(batches(0))
    state = tr.init()
    state, m = step(state, const)
    jax.block_until_ready(m)
    feeds = {"constant": None, "prefetch": Prefetch(batches(0), 2), "inline": batches(0)}
    times = {k: [] for k in feeds}
    for _ in range(args.rounds):
        for name, feed in feeds.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                state, m = step(state, const if feed is None else next(feed))
            jax.block_until_ready(m)
            times[name].append((time.perf_counter() - t) / args.steps)
    feeds["prefetch"].close()
    floor = float(np.median(times["constant"]))
    for name, ts in times.items():
        med = float(np.median(ts))
        print(
            json.dumps(
                {
                    "variant": name,
                    "step_ms_median": round(1e3 * med, 2),
                    "step_ms_min_max": [round(1e3 * min(ts), 2), round(1e3 * max(ts), 2)],
                    "vs_constant": round(med / floor, 3),
                }
            ),
            flush=True,
        )
    print(
        json.dumps(
            {
                "host_build_ms_per_batch": round(build_ms, 2),
                "batch": [cfg.batch.global_size, cfg.batch.length + 1],
                "mesh": tr.describe()["mesh_str"],
                "strategy": cfg.strategy,
            }
        )
    )


if __name__ == "__main__":
    main()
