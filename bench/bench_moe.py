"""MoE vs dense on 8 fake CPU devices: step time, per-step collective bytes, loss after a short run.

    python bench/bench_moe.py [--steps 30] [KEY=VALUE ...]

Runs configs/moe-tiny.yaml (expert=4 x data=2, dp preset) with top2, top1 and dropless routing, and
the dense decoder of the same size on the same mesh. CPU timings are only comparable to each other.
"""

from __future__ import annotations

import argparse
import json
import time

from meshpar.core.mesh import fake_cpu_devices

fake_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshpar.core.config import CONFIG_DIR, load_config  # noqa: E402
from meshpar.plan.inspect import collectives, summarize  # noqa: E402
from meshpar.train.batches import Batches  # noqa: E402
from meshpar.train.data import make_source  # noqa: E402
from meshpar.train.step import Trainer  # noqa: E402

VARIANTS = {
    "dense": ["model.name=decoder"],
    "moe-top2": ["moe.routing=top2"],
    "moe-top1": ["moe.routing=top1"],
    "moe-dropless": ["moe.capacity_factor=null"],
}


def bench(name: str, overrides: list[str], steps: int) -> dict:
    cfg = load_config(CONFIG_DIR / "moe-tiny.yaml", [f"steps={steps}"] + overrides)
    tr = Trainer(cfg)
    t0 = time.perf_counter()
    compiled = tr.compile()
    compile_s = time.perf_counter() - t0
    coll = summarize(collectives(compiled.as_text(), tr.describe()["mesh"]))
    state = tr.init()
    source = make_source(cfg.data, cfg.batch, cfg.eval, tr.spec.model_config.vocab)
    data = Batches(source, tr.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed)
    times, metrics = [], None
    for i in range(steps):
        batch = next(data)
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i >= 2:  # skip warm-up steps
            times.append(time.perf_counter() - t)
    m = jax.device_get(metrics)
    return {
        "variant": name,
        "params": tr.spec.num_params,
        "compile_s": round(compile_s, 2),
        "step_ms_median": round(1e3 * float(np.median(times)), 1),
        "final_loss": round(float(m["loss"]), 4),
        "drop_fraction": np.asarray(m.get("drop_fraction", [])).round(4).tolist(),
        "collective_bytes": {k: v["bytes"] for k, v in coll.items()},
        "collective_axes": {k: v["axes"] for k, v in coll.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    for name, ov in VARIANTS.items():
        print(json.dumps(bench(name, ov + args.overrides, args.steps)), flush=True)


if __name__ == "__main__":
    main()
