"""MoE step vs its dense twin, side by side in one process (issue 13's configuration).

    python bench/bench_moe_speed.py [--steps 20] [--rounds 5] [--variants dense,top2,...] [KEY=VALUE ...]
    DEVICES=1 python bench/bench_moe_speed.py ... mesh.fsdp=1 mesh.expert=1 strategy=dp   # one device

Configuration (issue 13): embed 256, 4 heads x 64, MLP 512, vocab 1024, 2 layers, sequence 128, global batch 8, mesh
fsdp=4 x expert=2, strategy fsdp, bf16, remat full; the MoE model has an MoE feed-forward in every layer (4 experts,
top-2, capacity 1.25). `top2-einsum` is the same MoE with GShard's einsum dispatch/combine
(meshpar.nn.moe.DISPATCH="einsum", the reference and the code before issue 13); `top2` uses the default gather
dispatch/combine. Both models get the same constant device batch, so only the train step is timed. The variants run
in interleaved rounds (dense, moe, dense, moe, ...) so load from other processes hits them alike. `floor-2x` and
`floor-2.5x` are dense twins whose MLP is 2x and 2.5x as wide: the FLOPs of top-2's routed rows and of its capacity
slots at 1.25, with no routing or exchange, so they bound what any top-2 MoE of this width can reach. The figure is
the median step time over all rounds after warm-up, and the ratio is MoE median / dense median. Also printed: the
all-to-all ops in the compiled step (count per step, bytes) for each variant.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from meshpar.core.mesh import fake_cpu_devices

fake_cpu_devices(int(os.environ.get("DEVICES", "8")))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshpar.core.config import load_config  # noqa: E402
from meshpar.plan.inspect import collectives, summarize  # noqa: E402
from meshpar.train.batches import Batches  # noqa: E402
from meshpar.train.data import make_source  # noqa: E402
from meshpar.train.step import Trainer  # noqa: E402

BASE = [
    "model.embed=256",
    "model.heads=4",
    "model.kv_heads=4",
    "model.head_dim=64",
    "model.mlp=512",
    "model.vocab=1024",
    "model.layers=2",
    "batch.length=128",
    "batch.global_size=8",
    "mesh.data=1",
    "mesh.fsdp=4",
    "mesh.tensor=1",
    "mesh.expert=2",
    "strategy=fsdp",
    "precision=bf16",
    "model.remat=full",
    "moe.num_experts=4",
    "moe.every=1",
    "moe.capacity_factor=1.25",
]
VARIANTS = {
    "dense": ["model.name=decoder"],
    # FLOP floors: dense twins whose one MLP is as wide as top-2's routed rows (2x) or top-2 x capacity 1.25's
    # expert slots (2.5x). No routing, no exchange: no top-2 MoE of this width can beat them.
    "floor-2x": ["model.name=decoder", "model.mlp=1024"],
    "floor-2.5x": ["model.name=decoder", "model.mlp=1280"],
    "top2": ["model.name=moe", "moe.routing=top2"],
    "top2-einsum": ["model.name=moe", "moe.routing=top2", "DISPATCH=einsum"],
    "top1": ["model.name=moe", "moe.routing=top1"],
    "dropless": ["model.name=moe", "moe.routing=top2", "moe.capacity_factor=null"],
}


def build(overrides: list[str]):
    """Compile one variant. `DISPATCH=einsum|gather` (not a config key) picks meshpar.nn.moe.DISPATCH."""
    from meshpar.nn import moe

    dispatch = [o.split("=", 1)[1] for o in overrides if o.startswith("DISPATCH=")]
    cfg = load_config(None, BASE + [o for o in overrides if not o.startswith("DISPATCH=")])
    default, moe.DISPATCH = moe.DISPATCH, (dispatch or [moe.DISPATCH])[0]
    try:
        tr = Trainer(cfg)
        compiled = tr.compile()
    finally:
        moe.DISPATCH = default
    coll = summarize(collectives(compiled.as_text(), tr.describe()["mesh"]))
    state = tr.init()
    data = Batches(
        make_source(cfg.data, cfg.batch, cfg.eval, cfg.model.vocab),
        tr.batch_sharding,
        cfg.batch.global_size,
        cfg.batch.length,
        cfg.data.seed,
    )
    batch = next(data)
    state, m = compiled(state, batch)  # warm-up (first execution)
    jax.block_until_ready(m)
    return {"compiled": compiled, "state": state, "batch": batch, "coll": coll, "times": []}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default="dense,top2")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    names = args.variants.split(",")
    runs = {n: build(VARIANTS[n] + args.overrides) for n in names}
    for _ in range(args.rounds):
        for n in names:
            r = runs[n]
            for _ in range(args.steps):
                t = time.perf_counter()
                r["state"], m = r["compiled"](r["state"], r["batch"])
                jax.block_until_ready(m)
                r["times"].append(time.perf_counter() - t)
    dense = float(np.median(runs["dense"]["times"])) if "dense" in runs else None
    for n in names:
        med = float(np.median(runs[n]["times"]))
        a2a = runs[n]["coll"].get("all-to-all", {"count": 0, "bytes": 0})
        quartiles = [round(1e3 * float(np.percentile(runs[n]["times"], q)), 2) for q in (25, 75)]
        print(
            json.dumps(
                {
                    "variant": n,
                    "step_ms_median": round(1e3 * med, 2),
                    "step_ms_p25_p75": quartiles,
                    "vs_dense": round(med / dense, 3) if dense else None,
                    "all_to_all_per_step": a2a["count"],
                    "all_to_all_bytes": a2a["bytes"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
