"""Serving benchmark: time to first token per prompt bucket, decode step time and tokens/s against the
number of slots, and the bytes each device reads per decode step against the step time.

    python bench/bench_serve.py                                       # 8 fake CPU devices, tensor=8
    python bench/bench_serve.py --devices 1 model.size=125m mesh.tensor=1      # one GPU (bf16)

Decode is memory-bound: each step reads every weight byte and every KV-cache byte a device holds once,
so achieved bytes/s per device = (weight bytes + cache bytes per device) / step time, the number to
hold against the device's memory bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s).
Prints one JSON object per measurement and a Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--slots", default="1,8,32", help="decode batch sizes to measure")
    p.add_argument("--cache", type=int, default=256, help="serve.cache_length")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--profile", metavar="DIR", help="also trace 5 decode steps per batch size (kernels by kind)")
    p.add_argument("overrides", nargs="*", help="config overrides (default: tensor=8, a 4-layer 256-wide model)")
    args = p.parse_args()
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax
    import numpy as np

    from meshpar.core.config import load_config
    from meshpar.serve.engine import Engine

    if args.profile:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_device import profile_summary

    base = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8", "precision=bf16"]
    if not any(o.startswith("model.size=") for o in args.overrides):  # a small model unless a size is named
        base += [
            "model.layers=4",
            "model.embed=256",
            "model.heads=8",
            "model.kv_heads=8",
            "model.head_dim=32",
            "model.mlp=1024",
            "model.vocab=1024",
        ]

    def peak_bytes():
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")

    rows, weights = [], None
    for slots in [int(s) for s in args.slots.split(",")]:
        cfg = load_config(
            None,
            base
            + list(args.overrides)
            + [f"serve.slots={slots}", f"serve.cache_length={args.cache}", "serve.min_bucket=16"],
        )
        eng = Engine(cfg, devices=jax.devices()[: args.devices], weights=weights, info=lambda m: None)
        weights = weights or jax.tree.map(np.asarray, eng.weights)
        peaks = {"built": peak_bytes()}  # the process's peak after each phase: which one sets it
        # time to first token per bucket (compiled first; median of 5 prefills + inserts)
        ttft = {}
        state = eng.new_state()
        for bucket in eng.buckets[:4]:
            prompt = list(np.arange(bucket) % eng.vocab)
            entry, tok, _ = eng.prefill(prompt)
            state = eng.insert(entry, state, 0)
            jax.block_until_ready(state)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                entry, tok, _ = eng.prefill(prompt)
                state = eng.insert(entry, state, 0)
                int(tok)
                times.append(time.perf_counter() - t)
            ttft[bucket] = statistics.median(times)
        peaks["prefilled"] = peak_bytes()
        # decode: every slot busy, `steps` generate calls after one warm-up
        state, toks, _ = eng.generate(state)
        jax.block_until_ready(toks)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            state, toks, _ = eng.generate(state)
            np.asarray(toks)  # the host reads each step's tokens, as `run` does
            times.append(time.perf_counter() - t)
        step = statistics.median(times)
        profile = None
        if args.profile:  # where a decode step's device time goes (bench/bench_device.py's summary)
            trace = os.path.join(args.profile, f"slots{slots}")
            with jax.profiler.trace(trace):
                for _ in range(5):
                    state, toks, _ = eng.generate(state)
                    np.asarray(toks)
            profile = profile_summary(trace, 5, top=12)
        b = eng.bytes_per_device()
        row = {
            "slots": slots,
            "ttft_s": ttft,
            "decode_step_s": step,
            "tokens_per_s": slots / step,
            "weight_bytes_per_device": b["weights"],
            "cache_bytes_per_device": b["cache"],
            "bytes_per_s_per_device": (b["weights"] + b["cache"]) / step,
            "traces": dict(eng.traces),
            # the process's peak so far (slots ascending, each engine dropped before the next: the last row's)
            "runtime_peak": peak_bytes(),
            "peak_after": {**peaks, "decoded": peak_bytes()},
            "profile": profile,
            "device": jax.devices()[0].device_kind,
            "mesh": dict(zip(eng.mesh.axis_names, eng.mesh.devices.shape)),
        }
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
        del eng, state, toks, entry  # its weights and cache leave the device before the next engine's arrive
        gc.collect()  # (the engine's programs and placement refer to each other)
    print(
        "\n| slots | TTFT by bucket (ms) | decode step (ms) | tokens/s | weights + cache per device (MB) "
        "| bytes/s per device (GB/s) |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        tt = ", ".join(f"{k}: {v * 1e3:.1f}" for k, v in r["ttft_s"].items())
        mb = (r["weight_bytes_per_device"] + r["cache_bytes_per_device"]) / 1e6
        print(
            f"| {r['slots']} | {tt} | {r['decode_step_s'] * 1e3:.2f} | {r['tokens_per_s']:,.0f} | {mb:.2f} | "
            f"{r['bytes_per_s_per_device'] / 1e9:.3f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
