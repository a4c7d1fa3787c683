"""Auxiliary-loss-free balancing (DeepSeek-V3's per-expert bias) on a router that prefers a few experts.

    python bench/bench_moe_balance.py [--steps 200] [KEY=VALUE ...]

A DeepSeek-style MoE LM (8 experts, top-2 by sigmoid scores, one shared expert, experts 64 wide,
dropless; MoE in every layer of 2) trains on the synthetic Markov stream, one device, fp32. Its
routers start skewed: column e of each router is scaled by 1 + e/2, so the experts with large
columns win the top-2 far more often. Runs from the same start: no balancing at all
(`moe.balance=aux moe.aux_loss_weight=0`), the GShard/Switch aux loss (weight 0.01), and the
bias (`moe.balance=bias`, aux loss off) at two rates. Printed per run: max/min expert load (the
worse of the two layers) on a fixed held-out batch of 64 x 64 tokens (8,192 assignments, so
sampling noise is ~3%) at steps 0, 10, 50, 100 and the end, and the final training loss.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from meshpar.core.config import load_config
from meshpar.train.batches import Batches
from meshpar.train.data import MarkovLanguage
from meshpar.train.step import Trainer

BASE = [
    "precision=fp32",
    "model.name=moe",
    "moe.every=1",
    "model.layers=2",
    "batch.length=64",
    "batch.global_size=8",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.score=sigmoid",
    "moe.shared_experts=1",
    "moe.expert_mlp=64",
    "moe.capacity_factor=null",
    "train.warmup_steps=10",
]
RUNS = {
    "no balancing": ["moe.balance=aux", "moe.aux_loss_weight=0"],
    "aux loss 0.01": ["moe.balance=aux", "moe.aux_loss_weight=0.01"],
    "bias, rate 0.001": ["moe.balance=bias", "moe.bias_rate=0.001"],
    "bias, rate 0.01": ["moe.balance=bias", "moe.bias_rate=0.01"],
}


def skew(state):
    """Scale router column e by 1 + e / 2 in every MoE layer."""
    params = dict(state["params"])
    layers = jax.tree.map(lambda x: x, params["layers"])
    r = layers["moe"]["ffn"]["router"]
    layers["moe"]["ffn"]["router"] = r * (1.0 + 0.5 * np.arange(r.shape[-1], dtype=np.float32))
    return {**state, "params": {**params, "layers": layers}}


def load_ratio(tr, state, tokens) -> float:
    """max/min expert load on `tokens`, the worse MoE layer, with the state's parameters and bias."""
    from meshpar.core.precision import use_policy

    model = tr.spec.merge(jax.device_get(state["params"]), jax.device_get(state["vars"]))
    with use_policy(tr.policy):
        _, aux = model(tokens)
    return round(float(np.max(np.asarray(aux["load_max"]) / np.asarray(aux["load_min"]))), 3)


def run(extra, steps):
    cfg = load_config(None, BASE + extra)
    tr = Trainer(cfg, devices=jax.devices()[:1])
    source = MarkovLanguage(tr.spec.model_config.vocab, 4, 1)
    data = Batches(
        source, tr.batch_sharding, cfg.batch.global_size, cfg.batch.length, cfg.data.seed, batch_spec=tr.batch_spec
    )
    held_out = np.asarray(source.rows(seed=123, step=0, rows=range(64), length=cfg.batch.length))[:, :-1]
    state = skew(tr.init())
    at, loss = {0: load_ratio(tr, state, held_out)}, None
    for s in range(1, steps + 1):
        state, m = tr.step(state, next(data))
        loss = float(m["loss"])
        if s in (10, 50, 100, steps):
            at[s] = load_ratio(tr, state, held_out)
    return at, loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    for name, extra in RUNS.items():
        at, loss = run(extra + args.overrides, args.steps)
        print(json.dumps({"run": name, "max_over_min_load_at_step": at, "final_loss": round(loss, 4)}), flush=True)


if __name__ == "__main__":
    main()
